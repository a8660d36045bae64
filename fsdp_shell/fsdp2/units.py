"""What a ``fully_shard`` call decides before any process group or runtime exists: the
parameters it manages and their layout, its settings, the plan request of its post-backward,
whether it reshards after forward, how its inputs are cast. The runtime (``api``, ``state``) and
the prediction (``fsdp_shell.predict``, which loads no runtime) both use these, so each rule has
one home."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map

from fsdp_core import (
    BackendCaps,
    CPUOffload,
    Division,
    DivisionPolicy,
    InputRole,
    MixedPrecision,
    PerParamLayout,
    PlanRequest,
    ShardedParam,
    ShardingSpec,
    ShardingStrategy,
    step_flags,
)

__all__ = [
    "Settings",
    "Slot",
    "cast_floats",
    "managed_params",
    "per_param_layout",
    "per_param_request",
    "reshards_after_forward",
]

Slot = tuple[nn.Module, str]
"""Where a parameter is registered: ``module._parameters[name]``."""


@dataclass(frozen=True, slots=True)
class Settings:
    """What ``FSDPModule``'s setters change, for one ``fully_shard`` call (replaced whole)."""

    reshard_after_forward: bool | int | None = None
    """None: every module but the root reshards after forward (FSDP2's default); an int (not a
    bool): reshards to groups of that many ranks (``FSDPState.post_forward_mesh``'s)."""
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    unshard_in_backward: bool = True
    """False: backward reads none of the unit's parameters (an embedding), so it is not gathered
    for backward (its gradients still accumulate on the unsharded parameters)."""
    gradient_divide_factor: float | None = None
    force_sum_reduction_for_comms: bool = False


def managed_params(
    modules: tuple[nn.Module, ...], ignored: set[nn.Parameter], sharded: Callable[[nn.Module], bool]
) -> tuple[list[nn.Parameter], list[list[Slot]], list[str]]:
    """The parameters ``fully_shard(modules)`` manages, in FSDP2's order (modules in post-order,
    each one's own parameters, none under a module ``sharded`` says ``fully_shard`` was applied
    to before), where each is registered, and its name under the given module (the prediction
    takes a model apart with it, ``fsdp_shell.predict.model``)."""
    roots = set(map(id, modules))
    seen: set[int] = set()
    order: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if id(m) not in roots and sharded(m):
            return
        seen.add(id(m))
        for child in m.children():
            if id(child) not in seen:
                visit(child)
        order.append(m)

    for m in modules:
        visit(m)
    names_of: dict[int, str] = {}
    for k, m in enumerate(modules):
        prefix = f"{k}." if len(modules) > 1 else ""
        for name, p in m.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), prefix + name)
    params: list[nn.Parameter] = []
    slots: list[list[Slot]] = []
    index: dict[int, int] = {}
    for m in order:
        for name, maybe in list(m._parameters.items()):
            if maybe is None or maybe in ignored:
                continue
            p = maybe
            if id(p) not in index:
                index[id(p)] = len(params)
                params.append(p)
                slots.append([])
            slots[index[id(p)]].append((m, name))
    return params, slots, [names_of.get(id(p), f"param{i}") for i, p in enumerate(params)]


def per_param_layout(
    params: list[nn.Parameter],
    names: list[str],
    world: int,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
) -> PerParamLayout:
    """The layout of one ``fully_shard`` call's parameters (one dtype) over ``world`` ranks: each
    on the dimension ``shard_placement_fn`` gives (0 where it gives None or there is none), a
    tensor-parallel ``DTensor`` by its local tensor."""
    specs = []
    for p, name in zip(params, names):
        dim = 0
        if shard_placement_fn is not None:
            placement = shard_placement_fn(p)
            if placement is not None:
                if not isinstance(placement, Shard):
                    raise TypeError(f"shard_placement_fn: expected Shard(dim) or None for {name!r}, got {placement!r}")
                dim = placement.dim % max(p.dim(), 1)
        local = p.to_local() if isinstance(p, DTensor) else p  # tensor parallelism: its local tensor
        specs.append(ShardedParam(name=name, shape=tuple(local.shape), shard_dim=dim))
    return PerParamLayout(params=tuple(specs), dtype=params[0].dtype, world=world)


def reshards_after_forward(value: bool | int | None, is_root: bool) -> bool:
    """Whether a unit with ``reshard_after_forward=value`` frees (or, an int, reshards to a
    smaller group) its unsharded parameters after forward: None, every unit but the root
    (FSDP2's default)."""
    return (not is_root) if value is None else bool(value)


def per_param_request(
    reduce_layout: PerParamLayout,
    *,
    replicate_size: int | None,
    rank: int,
    mp: MixedPrecisionPolicy,
    offload: bool,
    caps: BackendCaps,
    settings: Settings,
    roles: frozenset[InputRole],
    all_reduce_hook: bool,
) -> PlanRequest:
    """The post-backward plan request of a unit whose parameters that take gradients are
    ``reduce_layout`` (sharded over its ``world``), on shard ``rank``, replicated over
    ``replicate_size`` ranks (a 2-D mesh; None: a 1-D one), with ``caps`` the backend's (all
    sums with ``force_sum_reduction_for_comms``), the carried ``roles``: the runtime's and the
    prediction's (``fsdp_shell.predict.model``)."""
    s = settings
    hybrid = replicate_size is not None
    sharding = ShardingSpec(
        strategy=ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.FULL_SHARD,
        shard_size=reduce_layout.world,
        replicate_size=replicate_size if replicate_size is not None else 1,
        rank=rank,
    )
    if s.force_sum_reduction_for_comms:
        caps = BackendCaps()
    flags = step_flags(roles, sync_gradients=s.requires_gradient_sync, requires_all_reduce=s.requires_all_reduce)
    return PlanRequest(
        layout=reduce_layout,
        sharding=sharding,
        mixed_precision=MixedPrecision(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype),
        offload=CPUOffload(offload_params=offload),
        division=Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=caps, factor=s.gradient_divide_factor),
        flags=flags,
        reshard_after_backward=s.reshard_after_backward,
        all_reduce_hook=all_reduce_hook,
    )


def cast_floats(dtype: torch.dtype | None, tree: Any) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (None: as it is), as
    ``MixedPrecisionPolicy`` casts a unit's forward inputs and outputs."""
    if dtype is None:
        return tree
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and torch.is_floating_point(x) else x, tree)
