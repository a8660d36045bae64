"""A planning request (every descriptor for one unit and one backward) and the plan.

A unit is one flat parameter (the FSDP1 API, ``FlatParamLayout``) or one ``fully_shard`` group of
parameters sharded each on its own (``PerParamLayout``). The request answers every question the
planner, the verifier and the models ask of the layout (numels, dtypes, views), so none of them
reads a layout's fields for itself.

``PlanRequest`` is the cache key: equal requests give equal plans. Cross-descriptor rules
(which options combine) are checked in its ``__post_init__``, so an impossible combination
fails where it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import assert_never

import torch

from fsdp_core.plan.carry import carried_role
from fsdp_core.plan.ops import (
    Accumulate,
    AllReduce,
    AllReduceHookCall,
    Buffer,
    Cast,
    CommHookCall,
    CopyIn,
    Destination,
    Divide,
    EndOfBackwardWait,
    Free,
    FreeUnshardedParam,
    GradViews,
    Group,
    HandOff,
    Input,
    InputRole,
    Offload,
    Op,
    Pad,
    RecordStream,
    ReduceScatter,
    WaitStream,
)
from fsdp_core.spec.config import (
    CommHook,
    CPUOffload,
    HybridAllReduce,
    MixedPrecision,
    StepFlags,
)
from fsdp_core.spec.division import DivideFactors, Division
from fsdp_core.spec.layout import FlatParamLayout, ShardingSpec, ShardView, unsharded_views
from fsdp_core.spec.per_param import PerParamLayout

__all__ = ["Plan", "PlanRequest"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest:
    """Everything the post-backward of one unit depends on, for one backward.

    ``reshard_after_backward`` is ``fully_shard``'s setting (``set_reshard_after_backward``; None
    means True there); a flat parameter's strategy decides it, so it must stay None with a
    ``FlatParamLayout``. ``all_reduce_hook``: the unit has one (``set_all_reduce_hook``; only
    ``fully_shard`` units take one), called on the reduced gradient each step it is reduced."""

    layout: FlatParamLayout | PerParamLayout
    sharding: ShardingSpec
    mixed_precision: MixedPrecision = MixedPrecision()
    offload: CPUOffload = CPUOffload()
    comm_hook: CommHook = CommHook.NONE
    division: Division = Division()
    use_orig_params: bool = False
    flags: StepFlags = StepFlags()
    hybrid_all_reduce: HybridAllReduce = HybridAllReduce.ASYNC
    reshard_after_backward: bool | None = None
    all_reduce_hook: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        if isinstance(self.layout, PerParamLayout):
            _check_per_param(self, self.layout)
        elif self.reshard_after_backward is not None:
            raise ValueError(
                "reshard_after_backward: a flat parameter reshards as its sharding strategy says; "
                "only a per-parameter (fully_shard) unit takes it, so leave it None"
            )
        elif self.all_reduce_hook:
            raise ValueError(
                "all_reduce_hook: only a per-parameter (fully_shard) unit takes an all-reduce hook; a flat "
                "parameter takes comm_hook"
            )
        strategy = self.sharding.strategy
        flags = self.flags
        if self.hybrid_all_reduce is HybridAllReduce.SYNC and not strategy.is_hybrid:
            raise ValueError(
                f"hybrid_all_reduce: only hybrid strategies have a replicate all-reduce to place; "
                f"{strategy.name} needs 'async' (the default)"
            )
        if not strategy.is_hybrid and not flags.requires_all_reduce:
            raise ValueError(
                f"flags.requires_all_reduce: only hybrid strategies have a replicate all-reduce to "
                f"defer; {strategy.name} needs requires_all_reduce=True"
            )
        if not strategy.is_hybrid and flags.pending_partial:
            raise ValueError(
                f"flags.pending_partial: only hybrid strategies keep partial reductions; "
                f"{strategy.name} needs pending_partial=False"
            )
        if self.comm_hook is CommHook.REDUCE_SCATTER and not strategy.is_sharded:
            raise ValueError(
                "comm_hook: reduce_scatter needs a sharded strategy; NO_SHARD accepts allreduce, "
                "fp16_compress, bf16_compress or a user hook"
            )
        if self.comm_hook.is_low_precision and self.mixed_precision.reduce_dtype is not None:
            raise ValueError(
                f"comm_hook: {self.comm_hook.value} chooses the communication dtype itself and cannot "
                "be combined with mixed_precision.reduce_dtype; drop one of them"
            )
        if self.comm_hook is not CommHook.NONE and self.division.factor is not None:
            raise ValueError(
                "division.factor: a communication hook divides as its state says; a custom divide "
                "factor needs comm_hook=none"
            )

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the gradient autograd produces."""
        return self.mixed_precision.compute_dtype(
            self.layout.dtype, force_full_precision=self.flags.force_full_precision
        )

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype the plan hands to the shard-group collective (a compress hook then
        communicates in its own wire dtype and returns this one)."""
        if self.comm_hook.is_low_precision:
            return self.compute_dtype
        return self.mixed_precision.reduce_dtype_for(
            self.layout.dtype, force_full_precision=self.flags.force_full_precision
        )

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype the optimizer receives: the original dtype unless low-precision grads are kept."""
        if self.mixed_precision.keep_low_precision_grads and not self.flags.force_full_precision:
            return self.reduce_dtype
        return self.layout.dtype

    def group_size(self, group: Group) -> int:
        """How many ranks ``group`` has: the shard size for ``SHARD`` (the whole data-parallel
        group for ``NO_SHARD``), the replicate size for ``REPLICATE``."""
        match group:
            case Group.SHARD:
                return self.sharding.shard_size
            case Group.REPLICATE:
                return self.sharding.replicate_size
            case _:
                assert_never(group)

    @property
    def per_param(self) -> bool:
        """Whether the unit is a ``fully_shard`` group of parameters (else one flat parameter)."""
        return isinstance(self.layout, PerParamLayout)

    @property
    def pending_dtype(self) -> torch.dtype:
        """The dtype unsharded gradients accumulate in across backwards without reduction: the
        compute dtype for a flat parameter (FSDP1), the reduce dtype for a per-parameter unit
        (FSDP2's ``unsharded_accumulated_grad``)."""
        return self.reduce_dtype if self.per_param else self.compute_dtype

    @property
    def restores_pending(self) -> bool:
        """Whether the unsharded gradients kept from ``no_sync`` backwards go back into the
        unsharded parameters' ``.grad`` before the next backward computes new ones, so autograd
        adds into them in place and the plan finds them in its new gradient: a per-parameter unit
        whose pending dtype is its compute dtype (``ParamGroup.restore_pending``; kept in another
        dtype, they stay carried for the plan to add into)."""
        return self.per_param and self.pending_dtype == self.compute_dtype

    @property
    def exposes_views(self) -> bool:
        """Whether the final gradient is exposed as the original parameters' ``.grad`` views: with
        ``use_orig_params``, and for a per-parameter unit whenever it reduces (its parameters are
        the original ones; inside ``no_sync`` FSDP2 leaves their ``.grad`` as it was and keeps
        the unsharded gradients to itself)."""
        return self.use_orig_params or (self.per_param and self.flags.sync_gradients)

    @property
    def shard_numel(self) -> int:
        """This rank's reduced gradient, padding included: the flat parameter's shard
        (``ShardingSpec.shard_numel``) or a per-parameter unit's slice."""
        if isinstance(self.layout, PerParamLayout):
            return self.layout.slice_numel
        return self.sharding.shard_numel(self.layout)

    @property
    def padded_numel(self) -> int:
        """What the shard-group reduction reads: the padded flat gradient or a per-parameter unit's
        ``world`` slices (``shard_numel`` times the shards)."""
        return self.shard_numel * self.sharding.num_shards

    def shard_views(self) -> tuple[ShardView, ...]:
        """Where each parameter's gradient lies in the reduced gradient this rank keeps."""
        layout = self.layout
        if isinstance(layout, PerParamLayout):
            return layout.shard_views(self.sharding.rank)
        if self.sharding.strategy.is_sharded:
            return self.sharding.shard_views(layout)
        return unsharded_views(layout)

    def unsharded_views(self) -> tuple[ShardView, ...]:
        """Where each parameter's gradient lies in the unsharded gradient (inside ``no_sync``)."""
        if isinstance(self.layout, PerParamLayout):
            return self.layout.unsharded_views()
        return unsharded_views(self.layout)

    @property
    def should_free_in_backward(self) -> bool:
        """FSDP1's ``_should_free_in_backward``: sharded strategies free the unsharded parameter in
        the post-backward, except ZeRO-2 strategies inside ``no_sync``, which keep it to avoid
        all-gathering again in the next accumulation step. ``NO_SHARD`` with a compute dtype of
        its own frees its low-precision copy in every post-backward (FSDP1's ``post_reshard``).
        A per-parameter unit frees it as ``reshard_after_backward`` says (FSDP2: True unless set
        otherwise, inside ``no_sync`` too)."""
        if self.per_param:
            return self.reshard_after_backward is not False
        return self.sharding.strategy.plan_reshards(
            low_precision=self.compute_dtype != self.layout.dtype, sync_gradients=self.flags.sync_gradients
        )

    @property
    def reshards_after_backward(self) -> bool:
        """Whether the unsharded parameter is freed by the end of this backward (by the plan when
        ``should_free_in_backward``, else at the end of backward):
        ``ShardingStrategy.reshards_after_backward``; a per-parameter unit's plan decides alone."""
        if self.per_param:
            return self.should_free_in_backward
        return self.sharding.strategy.reshards_after_backward(self.flags.sync_gradients)


def _check_types(request: PlanRequest) -> None:
    expected: tuple[tuple[str, type | tuple[type, ...]], ...] = (
        ("layout", (FlatParamLayout, PerParamLayout)),
        ("sharding", ShardingSpec),
        ("mixed_precision", MixedPrecision),
        ("offload", CPUOffload),
        ("comm_hook", CommHook),
        ("division", Division),
        ("use_orig_params", bool),
        ("flags", StepFlags),
        ("hybrid_all_reduce", HybridAllReduce),
        ("reshard_after_backward", (bool, type(None))),
        ("all_reduce_hook", (bool,)),
    )
    for name, kind in expected:
        value = getattr(request, name)
        if not isinstance(value, kind):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise TypeError(f"{name}: expected {names}, got {type(value).__name__}")


def _check_per_param(r: PlanRequest, layout: PerParamLayout) -> None:
    """What a per-parameter (``fully_shard``) unit cannot combine with, named by argument."""
    strategy = r.sharding.strategy
    if not strategy.is_sharded:
        raise ValueError(
            "sharding.strategy: a per-parameter unit is sharded over its mesh's shard dimension "
            "(FULL_SHARD, SHARD_GRAD_OP, or HYBRID_SHARD[_ZERO2] on a 2-D mesh); a shard group of "
            "one rank is FULL_SHARD with shard_size=1, not NO_SHARD"
        )
    if layout.world != r.sharding.shard_size:
        raise ValueError(
            f"layout.world: the layout is sharded over {layout.world} ranks but the shard group has "
            f"{r.sharding.shard_size}; build both from the same mesh"
        )
    refused = (
        ("comm_hook", r.comm_hook is not CommHook.NONE, "fully_shard has no FSDP1 comm hooks"),
        ("use_orig_params", r.use_orig_params, "a per-parameter unit's parameters are the original ones"),
        (
            "mixed_precision.keep_low_precision_grads",
            r.mixed_precision.keep_low_precision_grads,
            "fully_shard casts reduced gradients to the parameters' dtype",
        ),
    )
    for name, bad, why in refused:
        if bad:
            raise ValueError(f"{name}: {why}; leave it at its default for a PerParamLayout")


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The post-backward of one flat parameter for one backward, as data.

    ``ops`` run in order, each enqueued on its stream. Ops from the first ``EndOfBackwardWait``
    on run in the end-of-backward callback; those before it run in the post-backward hook.
    """

    request: PlanRequest
    ops: tuple[Op, ...]
    factors: DivideFactors | None
    """The division used for the default collectives; None inside ``no_sync`` and with a comm
    hook (the hook's state divides)."""

    hand_off: HandOff | None = field(init=False, repr=False, compare=False)
    """The op that hands the gradient to the optimizer, if the plan has one (one, or none)."""
    destination: Destination | None = field(init=False, repr=False, compare=False)
    """Where the gradient ends up."""
    consumed: frozenset[InputRole] = field(init=False, repr=False, compare=False)
    """The carried roles this plan takes as inputs (every ``Input`` role but ``GRAD``): the
    buffers carried from earlier backwards that it uses up."""
    carried_out: InputRole | None = field(init=False, repr=False, compare=False)
    """The role under which the handed-off gradient enters the next backward
    (``carried_role(destination)``); None when the plan hands nothing off."""
    hook_ops: tuple[Op, ...] = field(init=False, repr=False, compare=False)
    """The ops run inside the post-backward hook: those before the first ``EndOfBackwardWait``."""
    callback_ops: tuple[Op, ...] = field(init=False, repr=False, compare=False)
    """The ops deferred to the end-of-backward callback."""
    src_dies: frozenset[int] = field(init=False, repr=False, compare=False)
    """The indices of the reduce-scatters whose input no later op uses before the plan frees it
    (``dies_after``): a collective may overwrite it."""

    def __post_init__(self) -> None:
        """What the runtime asks of every plan on every backward, worked out once here."""
        found = [op for op in self.ops if isinstance(op, HandOff)]
        hand_off = found[0] if len(found) == 1 else None
        destination = None if hand_off is None else hand_off.destination
        split = next((i for i, op in enumerate(self.ops) if isinstance(op, EndOfBackwardWait)), len(self.ops))
        consumed = frozenset(op.role for op in self.ops if isinstance(op, Input) and op.role is not InputRole.GRAD)
        derived = {
            "hand_off": hand_off,
            "destination": destination,
            "consumed": consumed,
            "carried_out": None if destination is None else carried_role(destination),
            "hook_ops": self.ops[:split],
            "callback_ops": self.ops[split:],
            "src_dies": frozenset(
                i for i, op in enumerate(self.ops) if isinstance(op, ReduceScatter) and dies_after(self.ops, i, op.src)
            ),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def should_free_in_backward(self) -> bool:
        """Whether the plan reshards (frees the unsharded parameter) in the post-backward."""
        return self.request.should_free_in_backward


def buffers_of(op: Op) -> tuple[Buffer, ...]:
    """The buffers an op reads or writes: its ``buffer``, or its ``src`` then its ``dst`` (once
    when they are the same buffer); none for waits and the reshard."""
    match op:
        case Input() | RecordStream() | Free() | Divide() | AllReduce() | AllReduceHookCall() | GradViews() | HandOff():
            return (op.buffer,)
        case Cast() | Pad() | CopyIn() | ReduceScatter() | CommHookCall() | Accumulate() | Offload():
            return (op.src,) if op.src == op.dst else (op.src, op.dst)
        case WaitStream() | EndOfBackwardWait() | FreeUnshardedParam():
            return ()
        case _:
            assert_never(op)


def dies_after(ops: tuple[Op, ...], index: int, buffer: Buffer) -> bool:
    """Whether no op after ``ops[index]`` reads or writes ``buffer`` before the plan frees it (a
    collective may then overwrite it: ``fsdp_core.execution.lane.scatter_form``'s ``src_dies``)."""
    for op in ops[index + 1 :]:
        if isinstance(op, Free) and op.buffer == buffer:
            return True
        if not isinstance(op, RecordStream) and buffer in buffers_of(op):
            return False
    return False
