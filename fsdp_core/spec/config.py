"""User-facing configuration values: strategy, prefetching, mixed precision, offload, comm hooks, step flags.

Every value here is immutable, hashable and validated on construction, so that a bad
configuration fails where it is written, never half-way through a backward pass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeVar, assert_never

import torch

__all__ = [
    "FLOAT_DTYPES",
    "HYBRID_STRATEGIES",
    "BackwardPrefetch",
    "CPUOffload",
    "CommHook",
    "HybridAllReduce",
    "MixedPrecision",
    "ShardingStrategy",
    "StepFlags",
    "parse_member",
]

_E = TypeVar("_E", bound=enum.Enum)


def parse_member(cls: type[_E], text: str, *, argument: str, noun: str, by_value: bool = False, also: str = "") -> _E:
    """The member of ``cls`` that ``text`` names: by name (any case, ``-`` for ``_``, a leading
    ``_`` ignored, as in torch's ``_HYBRID_SHARD_ZERO2``) or, with ``by_value``, by value (lower
    case). Otherwise ``ValueError`` naming ``argument`` and listing what is accepted."""
    key = text.strip().replace("-", "_")
    for member in cls:
        if (str(member.value) == key.lower()) if by_value else (member.name == key.upper().lstrip("_")):
            return member
    accepted = ", ".join(str(m.value) if by_value else m.name for m in cls)
    raise ValueError(f"{argument}: unknown {noun} {text!r}; accepted: {accepted}{also}")


FLOAT_DTYPES: frozenset[torch.dtype] = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
"""Parameter and gradient dtypes the planner accepts."""


class ShardingStrategy(enum.Enum):
    """How a flat parameter and its gradient are split across ranks (FSDP1's meaning)."""

    FULL_SHARD = "FULL_SHARD"
    """Shard parameters, gradients and optimizer state; free the unsharded parameter after forward."""
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    """Like FULL_SHARD, but keep the unsharded parameter from forward to backward (ZeRO-2)."""
    NO_SHARD = "NO_SHARD"
    """Replicate everything; gradients are all-reduced (DDP)."""
    HYBRID_SHARD = "HYBRID_SHARD"
    """FULL_SHARD inside a shard group, replicated across a replicate group."""
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"
    """SHARD_GRAD_OP inside a shard group, replicated across a replicate group."""

    @property
    def is_hybrid(self) -> bool:
        """Whether gradients are also all-reduced across a replicate group."""
        return self in HYBRID_STRATEGIES

    @property
    def is_sharded(self) -> bool:
        """Whether the flat parameter is split across the shard group."""
        return self is not ShardingStrategy.NO_SHARD

    @property
    def reshards_after_forward(self) -> bool:
        """Whether a unit frees its unsharded parameter after forward (``FULL_SHARD``,
        ``HYBRID_SHARD``; FSDP1 keeps the root's) and so gathers again in backward; the ZeRO-2
        strategies keep it from forward to backward."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    def reshards_after_forward_with(self, low_precision: bool) -> bool:
        """``reshards_after_forward``, and for ``NO_SHARD`` whether its parameters are cast to a
        compute dtype of their own (``low_precision``): FSDP1 frees that copy at every reshard
        (``post_reshard``), so it is cast again for backward."""
        return self.reshards_after_forward or (low_precision and not self.is_sharded)

    def reshards_after_backward(self, sync_gradients: bool) -> bool:
        """Whether the unsharded parameter is freed by the end of a backward: always when
        gradients are synchronised; inside ``no_sync`` only by strategies that reshard after
        forward anyway, so the ZeRO-2 strategies and ``NO_SHARD`` keep it for the next
        accumulation step (FSDP1's ``_should_free_in_backward`` for the sharded ones)."""
        return sync_gradients or self.reshards_after_forward

    def plan_reshards(self, *, low_precision: bool, sync_gradients: bool) -> bool:
        """Whether the post-backward plan frees the unsharded parameter in its hook (FSDP1's
        ``_should_free_in_backward``): sharded strategies as ``reshards_after_backward`` says, so
        not the ZeRO-2 ones inside ``no_sync``, which keep it for the next accumulation step;
        ``NO_SHARD`` frees a low-precision copy of its own in every post-backward (FSDP1's
        ``post_reshard``) and has nothing else to free."""
        if not self.is_sharded:
            return low_precision
        return self.reshards_after_backward(sync_gradients)

    @classmethod
    def parse(cls, name: str) -> ShardingStrategy:
        """Return the member called ``name`` (case-insensitive), or raise ``ValueError``."""
        return parse_member(cls, name, argument="sharding_strategy", noun="strategy")


class BackwardPrefetch(enum.Enum):
    """When FSDP1 issues the next unit's all-gather during backward (its ``backward_prefetch``).

    ``None`` in its place means no backward prefetch: each unit is all-gathered in its own
    pre-backward hook, and its backward waits for that all-gather.
    """

    BACKWARD_PRE = "BACKWARD_PRE"
    """In a unit's pre-backward hook, right after its own all-gather: overlaps the next unit's
    all-gather with this unit's backward (FSDP1's default; two unsharded units at a time)."""
    BACKWARD_POST = "BACKWARD_POST"
    """In a unit's post-backward hook, after it resharded: less overlap, less memory."""

    @classmethod
    def parse(cls, name: str) -> BackwardPrefetch:
        """Return the member called ``name`` (case-insensitive), or raise ``ValueError``."""
        return parse_member(cls, name, argument="backward_prefetch", noun="value", also=" (or None)")


HYBRID_STRATEGIES: frozenset[ShardingStrategy] = frozenset(
    {ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2}
)


def _check_float_dtype(argument: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype) or value not in FLOAT_DTYPES:
        accepted = ", ".join(sorted(str(d) for d in FLOAT_DTYPES))
        raise TypeError(f"{argument}: expected None or one of {accepted}, got {value!r}")


class HybridAllReduce(enum.Enum):
    """Where hybrid strategies run the replicate all-reduce.

    ``ASYNC`` (the default; PyTorch PR 106080): on a stream of its own, waiting only for the
    reduce-scatter that produced its input, so it overlaps the next units' reduce-scatters,
    all-gathers and backward. ``SYNC`` (FSDP1 before that PR): on the post-backward stream right
    after the reduce-scatter, so the next unit's reduce-scatter waits for it."""

    ASYNC = "async"
    SYNC = "sync"

    @classmethod
    def parse(cls, name: str) -> HybridAllReduce:
        """The member whose value is ``name`` (case-insensitive), or ``ValueError``."""
        return parse_member(cls, name, argument="hybrid_all_reduce", noun="placement", by_value=True)


@dataclass(frozen=True, slots=True)
class MixedPrecision:
    """FSDP1's mixed-precision settings.

    ``param_dtype`` is the compute dtype of the unsharded parameter (and so of the gradient
    autograd produces). Gradients are reduced in ``reduce_dtype``, or in ``param_dtype`` when
    ``reduce_dtype`` is None. The optimizer receives gradients in the parameter's original
    dtype unless ``keep_low_precision_grads``, in which case it receives the reduce dtype.

    The rest concern the forward, not the gradient's plan: floating-point buffers are kept in
    ``buffer_dtype`` (None: their own dtype; state dicts give them in their own dtype either way);
    ``cast_forward_inputs`` casts every unit's floating-point forward inputs to ``param_dtype``,
    ``cast_root_forward_inputs`` (default) the root's.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    buffer_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True

    def __post_init__(self) -> None:
        _check_float_dtype("mixed_precision.param_dtype", self.param_dtype)
        _check_float_dtype("mixed_precision.reduce_dtype", self.reduce_dtype)
        _check_float_dtype("mixed_precision.buffer_dtype", self.buffer_dtype)
        for name in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"mixed_precision.{name}: expected a bool, got {value!r}")

    def compute_dtype(self, orig: torch.dtype, *, force_full_precision: bool = False) -> torch.dtype:
        """The dtype of the gradient autograd produces for a parameter of dtype ``orig``."""
        if force_full_precision or self.param_dtype is None:
            return orig
        return self.param_dtype

    def reduce_dtype_for(self, orig: torch.dtype, *, force_full_precision: bool = False) -> torch.dtype:
        """The dtype gradients are reduced in for a parameter of dtype ``orig``."""
        if force_full_precision:
            return orig
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return self.compute_dtype(orig)


@dataclass(frozen=True, slots=True)
class CPUOffload:
    """FSDP1's CPU offload: with ``offload_params`` the sharded parameter and its gradient live
    on the CPU and the optimizer steps there."""

    offload_params: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.offload_params, bool):
            raise TypeError(f"cpu_offload.offload_params: expected a bool, got {self.offload_params!r}")


class CommHook(enum.Enum):
    """Which communication hook replaces the shard-group collective.

    The built-in hooks have FSDP1's ``default_hooks`` semantics: each averages over the group
    it is given (FSDP1's pre/post divide split of that group's size). ``USER`` is an opaque
    user hook with FSDP1's signature ``hook(state, grad, output=None)``; the plan assumes the
    same contract: it reduces ``grad`` over the shard group, averaging, and writes this rank's
    shard into ``output`` (or reduces ``grad`` in place for ``NO_SHARD``).
    """

    NONE = "none"
    ALLREDUCE = "allreduce"
    """All-reduce the whole padded gradient, then keep this rank's shard."""
    REDUCE_SCATTER = "reduce_scatter"
    """Reduce-scatter the padded gradient (sharded strategies only)."""
    FP16_COMPRESS = "fp16_compress"
    """Cast to float16, reduce, cast back to the gradient's dtype."""
    BF16_COMPRESS = "bf16_compress"
    """Cast to bfloat16, reduce, cast back to the gradient's dtype."""
    USER = "user"

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype a compress hook communicates in, None for the others."""
        match self:
            case CommHook.FP16_COMPRESS:
                return torch.float16
            case CommHook.BF16_COMPRESS:
                return torch.bfloat16
            case CommHook.NONE | CommHook.ALLREDUCE | CommHook.REDUCE_SCATTER | CommHook.USER:
                return None
            case _:
                assert_never(self)

    @property
    def is_low_precision(self) -> bool:
        """Whether the hook owns the cast to and from its wire dtype (FSDP1's low-precision hooks)."""
        return self.wire_dtype is not None

    @classmethod
    def parse(cls, name: str) -> CommHook:
        """Return the hook called ``name`` (its value, e.g. ``"fp16_compress"``), or raise ``ValueError``."""
        return parse_member(cls, name, argument="comm_hook", noun="hook", by_value=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFlags:
    """Explicit per-backward state: what FSDP1 keeps as ``hasattr`` flags on the flat parameter.

    The shell derives these from its own bookkeeping and passes them in; the planner never
    inspects tensors.
    """

    sync_gradients: bool = True
    """False inside ``no_sync()``: accumulate the unsharded gradient locally, communicate nothing."""
    accumulate: bool = False
    """A sharded (reduced) gradient from an earlier backward exists; add this one into it."""
    pending_unsharded: bool = False
    """An unsharded gradient accumulated by earlier ``no_sync`` backwards exists; it is added to
    this backward's gradient before reduction (or, inside ``no_sync``, this one is added to it)."""
    requires_all_reduce: bool = True
    """Hybrid only. False defers the replicate all-reduce: the shard-group result is kept as a
    partial reduction (FSDP2's ``set_requires_all_reduce(False)`` for gradient accumulation)."""
    pending_partial: bool = False
    """Hybrid only. A partial reduction kept by earlier backwards without all-reduce exists; it
    is added before the next all-reduce (or into, when the all-reduce is deferred again)."""
    force_full_precision: bool = False
    """Compute and reduce in the parameter's original dtype this step (FSDP1's full precision in eval)."""

    def __post_init__(self) -> None:
        for name in (
            "sync_gradients",
            "accumulate",
            "pending_unsharded",
            "requires_all_reduce",
            "pending_partial",
            "force_full_precision",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"flags.{name}: expected a bool, got {value!r}")
