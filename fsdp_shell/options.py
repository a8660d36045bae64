"""Accept ``torch.distributed.fsdp``'s config objects as well as fsdp_core's, mapped by name."""

from __future__ import annotations

import torch

from fsdp_core import (
    BackwardPrefetch,
    CPUOffload,
    DivisionPolicy,
    HybridAllReduce,
    MixedPrecision,
    ShardingStrategy,
    parse_member,
)

__all__ = [
    "to_backward_prefetch",
    "to_cpu_offload",
    "to_division_policy",
    "to_hybrid_all_reduce",
    "to_mixed_precision",
    "to_sharding_strategy",
]


def to_sharding_strategy(value: object) -> ShardingStrategy:
    """fsdp_core's member of the same name as ``value`` (ours, torch's, or a string)."""
    if isinstance(value, ShardingStrategy):
        return value
    name = getattr(value, "name", value)
    if isinstance(name, str):
        return ShardingStrategy.parse(name)
    accepted = ", ".join(m.name for m in ShardingStrategy)
    raise TypeError(f"sharding_strategy: expected a ShardingStrategy ({accepted}), got {value!r}")


def to_mixed_precision(value: object) -> MixedPrecision:
    """fsdp_core's ``MixedPrecision`` from ours, torch's (same field names) or None."""
    if value is None:
        return MixedPrecision()
    if isinstance(value, MixedPrecision):
        return value
    fields = ("param_dtype", "reduce_dtype", "keep_low_precision_grads")
    if all(hasattr(value, f) for f in fields):
        buffer_dtype = getattr(value, "buffer_dtype", None)
        if buffer_dtype is not None:
            raise ValueError("mixed_precision.buffer_dtype: buffers are kept in their own dtype; pass None")
        param_dtype, reduce_dtype = getattr(value, "param_dtype"), getattr(value, "reduce_dtype")
        keep = getattr(value, "keep_low_precision_grads")
        if (param_dtype is not None and not isinstance(param_dtype, torch.dtype)) or (
            reduce_dtype is not None and not isinstance(reduce_dtype, torch.dtype)
        ) or not isinstance(keep, bool):
            raise TypeError(f"mixed_precision: fields of {value!r} are not dtypes/bool")
        return MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, keep_low_precision_grads=keep)
    raise TypeError(f"mixed_precision: expected None or a MixedPrecision (fsdp_core's or torch's), got {value!r}")


def to_cpu_offload(value: object) -> CPUOffload:
    """fsdp_core's ``CPUOffload`` from ours, torch's or None."""
    if value is None:
        return CPUOffload()
    if isinstance(value, CPUOffload):
        return value
    offload = getattr(value, "offload_params", None)
    if isinstance(offload, bool):
        return CPUOffload(offload_params=offload)
    raise TypeError(f"cpu_offload: expected None or a CPUOffload (fsdp_core's or torch's), got {value!r}")


def to_backward_prefetch(value: object) -> BackwardPrefetch | None:
    """fsdp_core's ``BackwardPrefetch`` member of the same name as ``value`` (ours, torch's
    ``torch.distributed.fsdp.BackwardPrefetch``, or a string, any case), or None for None or
    ``"none"``."""
    if value is None or isinstance(value, BackwardPrefetch):
        return value
    if isinstance(value, str):
        return None if value.strip().lower() == "none" else BackwardPrefetch.parse(value)
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return BackwardPrefetch.parse(name)
    raise TypeError(
        f"backward_prefetch: expected None or a BackwardPrefetch (BACKWARD_PRE, BACKWARD_POST; fsdp_core's "
        f"or torch's), got {value!r}"
    )


def to_division_policy(value: object) -> DivisionPolicy:
    """``DivisionPolicy`` from itself or its value (``"pre_post"``, ``"in_collective"``)."""
    if isinstance(value, DivisionPolicy):
        return value
    if isinstance(value, str):
        return parse_member(DivisionPolicy, value, argument="division_policy", noun="policy", by_value=True)
    raise TypeError(f"division_policy: expected a DivisionPolicy or its value, got {value!r}")


def to_hybrid_all_reduce(value: object) -> HybridAllReduce:
    """``HybridAllReduce`` from itself or its value (``"async"``, ``"sync"``)."""
    if isinstance(value, HybridAllReduce):
        return value
    if isinstance(value, str):
        return HybridAllReduce.parse(value)
    raise TypeError(f"hybrid_all_reduce: expected 'async', 'sync' or a HybridAllReduce, got {value!r}")
