"""Build the post-backward plan of one unit: a flat parameter or a per-parameter group.

A plan is built by threading an immutable ``Draft`` (the ops so far, which buffer holds the
gradient, which stream we are on) through a pipeline of pure stages. The shape of the
reduction is chosen by a dispatch table from layout and strategy to builder, not by an
if-ladder. The two layouts share every stage but the one that makes the reduce-scatter input:
a flat parameter's gradient is cast and padded (``_cast_to_reduce_dtype``, ``_pad_to_shards``);
a per-parameter unit's gradients are copied in, cast on the way (``_copy_in``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import assert_never

import torch
from toolz import pipe

from fsdp_core.plan.ops import (
    Accumulate,
    AllReduce,
    AllReduceHookCall,
    Buffer,
    Cast,
    CommHookCall,
    CopyIn,
    Destination,
    Device,
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
    Stream,
    WaitStream,
)
from fsdp_core.plan.request import Plan, PlanRequest, buffers_of
from fsdp_core.plan.verifier import check_plan
from fsdp_core.problems import Problem
from fsdp_core.spec.config import CommHook, CPUOffload, HybridAllReduce, MixedPrecision, ShardingStrategy, StepFlags
from fsdp_core.spec.division import DivideFactors, Division, divide_factors
from fsdp_core.spec.layout import FlatParamLayout, ShardingSpec
from fsdp_core.spec.per_param import PerParamLayout

__all__ = [
    "PER_PARAM_BUILDERS",
    "PLAN_BUILDERS",
    "PlanCache",
    "UnsoundPlanError",
    "all_reduce_stream",
    "build_plan",
    "plan_post_backward",
]


@dataclass(frozen=True, slots=True)
class Draft:
    """A plan under construction: ``grad`` holds the gradient being processed, on ``stream``."""

    request: PlanRequest
    ops: tuple[Op, ...]
    grad: Buffer
    stream: Stream
    factors: DivideFactors | None = None
    destination: Destination | None = None


Stage = Callable[[Draft], Draft]


def _emit(d: Draft, *ops: Op, grad: Buffer | None = None, stream: Stream | None = None) -> Draft:
    return replace(
        d,
        ops=d.ops + ops,
        grad=d.grad if grad is None else grad,
        stream=d.stream if stream is None else stream,
    )


def _alloc_stream(ops: tuple[Op, ...], buffer: Buffer) -> Stream:
    for op in ops:
        if buffer in buffers_of(op):
            return op.stream
    raise AssertionError(f"buffer {buffer.name} used before it was introduced")


def _release(d: Draft, buffer: Buffer) -> tuple[Op, ...]:
    """Ops that drop ``buffer`` safely: record it on the current stream if it was allocated on
    another one (the caching allocator must not hand its memory out while this stream still
    reads it), then free it on its allocation stream."""
    alloc = _alloc_stream(d.ops, buffer)
    recorded = {op.stream for op in d.ops if isinstance(op, RecordStream) and op.buffer == buffer}
    ops: list[Op] = []
    if alloc is not d.stream and d.stream not in recorded:
        ops.append(RecordStream(buffer=buffer, stream=d.stream))
    ops.append(Free(buffer=buffer, stream=alloc))
    return tuple(ops)


def _replace_grad(d: Draft, op: Op, new: Buffer) -> Draft:
    """Emit ``op`` (which derives ``new`` from the current gradient) and release the old one."""
    d2 = _emit(d, op)
    return _emit(d2, *_release(d2, d.grad), grad=new)


_DTYPE_TAGS: Mapping[torch.dtype, str] = MappingProxyType(
    {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
)
"""The suffix of a gradient buffer cast to each of ``FLOAT_DTYPES`` (``grad.bf16``)."""


def _dtype_tag(dtype: torch.dtype) -> str:
    return _DTYPE_TAGS[dtype]


def _switch_stream(d: Draft, stream: Stream) -> Draft:
    if d.stream is stream:
        return d
    d2 = _emit(d, WaitStream(stream=stream, waits_for=d.stream), stream=stream)
    return _emit(d2, RecordStream(buffer=d.grad, stream=stream))


# -- stages shared by every strategy ------------------------------------------------------


def _inputs(d: Draft) -> Draft:
    """Declare what exists when the hook fires: the new gradient and any pending state."""
    r, f = d.request, d.request.flags
    ops: list[Op] = []
    if r.should_free_in_backward:
        ops.append(FreeUnshardedParam(stream=Stream.COMPUTE))
    ops.append(Input(buffer=d.grad, role=InputRole.GRAD, stream=Stream.COMPUTE))
    if f.pending_unsharded:
        ops.append(Input(buffer=_pending_unsharded(r), role=InputRole.PENDING_UNSHARDED))
    if f.sync_gradients and f.accumulate and not _defers_all_reduce(r):
        ops.append(Input(buffer=_saved_grad(r), role=InputRole.SHARDED_GRAD))
    if f.sync_gradients and f.pending_partial:
        ops.append(Input(buffer=_partial(r), role=InputRole.PENDING_PARTIAL))
    return _emit(d, *ops)


def _merge_pending_unsharded(d: Draft) -> Draft:
    """Add this backward's gradient into the one accumulated by earlier ``no_sync`` backwards;
    inside ``no_sync`` with none yet, keep this one in the dtype unsharded gradients accumulate in
    (``PlanRequest.pending_dtype``: a per-parameter unit's reduce dtype)."""
    r = d.request
    if not r.flags.pending_unsharded:
        if r.flags.sync_gradients or d.grad.dtype is r.pending_dtype:
            return d
        new = Buffer(name=f"grad.{_dtype_tag(r.pending_dtype)}", numel=d.grad.numel, dtype=r.pending_dtype)
        return _replace_grad(d, Cast(src=d.grad, dst=new, stream=d.stream), new)
    pending = _pending_unsharded(r)
    return _replace_grad(d, Accumulate(dst=pending, src=d.grad, stream=d.stream), pending)


def _to_post_backward_stream(d: Draft) -> Draft:
    return _emit(d, WaitStream(stream=Stream.POST_BACKWARD, waits_for=Stream.COMPUTE), stream=Stream.POST_BACKWARD)


def _cast_to_reduce_dtype(d: Draft) -> Draft:
    want = d.request.reduce_dtype
    if d.grad.dtype is want:
        return d
    new = Buffer(name=f"grad.{_dtype_tag(want)}", numel=d.grad.numel, dtype=want)
    return _replace_grad(d, Cast(src=d.grad, dst=new, stream=d.stream), new)


def _pad_to_shards(d: Draft) -> Draft:
    padded = d.request.padded_numel
    if d.grad.numel == padded:
        return d
    new = Buffer(name="grad.padded", numel=padded, dtype=d.grad.dtype)
    return _replace_grad(d, Pad(src=d.grad, dst=new, stream=d.stream), new)


def _copy_in(d: Draft) -> Draft:
    """A per-parameter unit's reduce-scatter input: every gradient's chunks copied rank-major
    into one buffer, cast to the reduce dtype on the way (``CopyIn``)."""
    r = d.request
    assert isinstance(r.layout, PerParamLayout)
    new = Buffer(name="grad.in", numel=r.padded_numel, dtype=r.reduce_dtype)
    return _replace_grad(d, CopyIn(src=d.grad, dst=new, layout=r.layout, stream=d.stream), new)


def _divide(d: Draft, factor: float) -> Draft:
    if factor == 1.0:
        return d
    return _emit(d, Divide(buffer=d.grad, factor=factor, stream=d.stream))


def _shard_group_factors(r: PlanRequest) -> DivideFactors:
    return divide_factors(
        shard_size=r.sharding.shard_size,
        replicate_size=r.sharding.replicate_size,
        reduce_dtype=r.reduce_dtype,
        division=r.division,
    )


def _hook_call(d: Draft, dst: Buffer) -> Draft:
    r = d.request
    wire = r.comm_hook.wire_dtype or d.grad.dtype
    call = CommHookCall(
        hook=r.comm_hook,
        src=d.grad,
        dst=dst,
        group=Group.SHARD,
        divides_by=r.sharding.shard_size,
        wire_dtype=wire,
        stream=d.stream,
    )
    return _emit(d, call)


def _reduce_scatter(d: Draft) -> Draft:
    """Shard-group reduction of a sharded strategy: reduce-scatter (or the hook) into a new shard."""
    r = d.request
    shard = Buffer(name="shard", numel=r.shard_numel, dtype=d.grad.dtype)
    if r.comm_hook is not CommHook.NONE:
        d2 = _hook_call(d, shard)
        return _emit(d2, *_release(d2, d.grad), grad=shard)
    factors = _shard_group_factors(r)
    d2 = _divide(replace(d, factors=factors), factors.pre)
    rs = ReduceScatter(src=d2.grad, dst=shard, group=Group.SHARD, reduce_op=factors.reduce_scatter_op, stream=d2.stream)
    d3 = _emit(d2, rs)
    return _emit(d3, *_release(d3, d2.grad), grad=shard)


def _post_divide(d: Draft) -> Draft:
    if d.request.comm_hook is not CommHook.NONE or d.factors is None:
        return d
    return _divide(d, d.factors.post)


def _all_reduce_no_shard(d: Draft) -> Draft:
    r = d.request
    if r.comm_hook is not CommHook.NONE:
        return _hook_call(d, d.grad)
    factors = _shard_group_factors(r)
    d2 = _divide(replace(d, factors=factors), factors.pre)
    ar = AllReduce(buffer=d2.grad, group=Group.SHARD, reduce_op=factors.reduce_scatter_op, stream=d2.stream)
    return _post_divide(_emit(d2, ar))


def _replicate_all_reduce(d: Draft) -> Draft:
    """Hybrid: fold in a pending partial, then either defer the all-reduce (keeping a partial)
    or all-reduce across replicas and divide what remains: on the all-reduce stream (``ASYNC``)
    or right after the reduce-scatter on the post-backward stream (``SYNC``)."""
    r = d.request
    if _defers_all_reduce(r):
        if not r.flags.pending_partial:
            return replace(d, destination=Destination.PARTIAL)
        partial = _partial(r)
        d2 = _replace_grad(d, Accumulate(dst=partial, src=d.grad, stream=d.stream), partial)
        return replace(d2, destination=Destination.PARTIAL)
    if r.flags.pending_partial:
        partial = _partial(r)
        d2 = _emit(d, Accumulate(dst=d.grad, src=partial, stream=d.stream))
        d = _emit(d2, *_release(d2, partial))
    d = _switch_stream(d, all_reduce_stream(r.hybrid_all_reduce))
    if r.comm_hook is not CommHook.NONE:
        # The hook averaged over the shard group; what remains is one reduction over the
        # replicate group, divided by the rule for a single collective of that size.
        rest = divide_factors(
            shard_size=r.sharding.replicate_size,
            replicate_size=1,
            reduce_dtype=d.grad.dtype,
            division=Division(policy=r.division.policy, backend=r.division.backend),
        )
        d = _divide(d, rest.pre)
        ar = AllReduce(buffer=d.grad, group=Group.REPLICATE, reduce_op=rest.reduce_scatter_op, stream=d.stream)
        return _divide(_emit(d, ar), rest.post)
    assert d.factors is not None
    ar = AllReduce(buffer=d.grad, group=Group.REPLICATE, reduce_op=d.factors.all_reduce_op, stream=d.stream)
    return _post_divide(_emit(d, ar))


def all_reduce_stream(placement: HybridAllReduce) -> Stream:
    """The stream a hybrid strategy's replicate all-reduce runs on: one of its own (``ASYNC``,
    PyTorch PR 106080), so it overlaps the next reduce-scatters and all-gathers, or the
    post-backward stream right after the reduce-scatter (``SYNC``, FSDP1 before it)."""
    match placement:
        case HybridAllReduce.ASYNC:
            return Stream.ALL_REDUCE
        case HybridAllReduce.SYNC:
            return Stream.POST_BACKWARD
        case _:
            assert_never(placement)


def _all_reduce_hook(d: Draft) -> Draft:
    """FSDP2's ``set_all_reduce_hook``: once the gradient is reduced over every group and divided,
    the unit's hook is called on it in place, on the all-reduce stream (FSDP2 calls it there,
    before a division it splits around the reduction: fp16, or sums forced). Not on a kept
    partial reduction: FSDP2 returns before the hook when it defers the all-reduce."""
    r = d.request
    if not r.all_reduce_hook or d.destination is Destination.PARTIAL:
        return d
    d = _switch_stream(d, all_reduce_stream(r.hybrid_all_reduce))
    return _emit(d, AllReduceHookCall(buffer=d.grad, stream=d.stream))


def _cast_to_grad_dtype(d: Draft) -> Draft:
    if d.destination is Destination.PARTIAL:
        return d
    want = d.request.grad_dtype
    if d.grad.dtype is want:
        return d
    base = d.grad.name.split(".")[0]
    new = Buffer(name=f"{base}.{_dtype_tag(want)}", numel=d.grad.numel, dtype=want)
    return _replace_grad(d, Cast(src=d.grad, dst=new, stream=d.stream), new)


def _accumulate_or_offload(d: Draft) -> Draft:
    """Accumulate into the existing sharded gradient, and/or copy the result to the host."""
    if d.destination is Destination.PARTIAL:
        return d
    r = d.request
    if r.offload.offload_params:
        cpu = _saved_grad(r)
        op = Offload(src=d.grad, dst=cpu, accumulate=r.flags.accumulate, stream=d.stream)
        return replace(_replace_grad(d, op, cpu), destination=Destination.CPU_GRAD)
    if r.flags.accumulate:
        saved = _saved_grad(r)
        op2 = Accumulate(dst=saved, src=d.grad, stream=d.stream)
        return replace(_replace_grad(d, op2, saved), destination=Destination.ACCUMULATED_GRAD)
    return replace(d, destination=Destination.SHARDED_GRAD)


def _end_of_backward(d: Draft) -> Draft:
    """Defer the rest to the end-of-backward callback: the compute stream waits for every side
    stream the plan used, and the remaining stages run on compute with the gradient final.
    Inside ``no_sync`` nothing left compute, so there is nothing to wait for."""
    used = {op.stream for op in d.ops} - {Stream.COMPUTE}
    waits = tuple(
        EndOfBackwardWait(stream=Stream.COMPUTE, waits_for=s)
        for s in (Stream.POST_BACKWARD, Stream.ALL_REDUCE)
        if s in used
    )
    return _emit(d, *waits, stream=Stream.COMPUTE)


def _grad_views(d: Draft) -> Draft:
    """Expose the final gradient as the original parameters' ``.grad`` (``use_orig_params``);
    nothing for a kept partial reduction, which is no gradient yet."""
    r = d.request
    if not r.exposes_views or d.destination is Destination.PARTIAL:
        return d
    views = r.shard_views() if r.flags.sync_gradients else r.unsharded_views()
    return _emit(d, GradViews(buffer=d.grad, views=views, stream=d.stream))


def _hand_off(d: Draft) -> Draft:
    """Hand the gradient over at its destination (inside ``no_sync``: the unsharded gradient)."""
    destination = d.destination or Destination.UNSHARDED_GRAD
    return _emit(d, HandOff(buffer=d.grad, destination=destination, stream=d.stream))


# -- named buffers for state carried between backwards --------------------------------------


def _pending_unsharded(r: PlanRequest) -> Buffer:
    return Buffer(name="grad.pending", numel=r.layout.total_numel, dtype=r.pending_dtype)


def _saved_grad(r: PlanRequest) -> Buffer:
    numel = r.shard_numel
    device = Device.HOST if r.offload.offload_params else Device.DEVICE
    name = "cpu_grad" if r.offload.offload_params else "sharded_grad"
    return Buffer(name=name, numel=numel, dtype=r.grad_dtype, device=device)


def _partial(r: PlanRequest) -> Buffer:
    return Buffer(name="partial", numel=r.shard_numel, dtype=r.reduce_dtype)


def _defers_all_reduce(r: PlanRequest) -> bool:
    return r.sharding.strategy.is_hybrid and not r.flags.requires_all_reduce


# -- the dispatch table ----------------------------------------------------------------------

_END_OF_BACKWARD: tuple[Stage, ...] = (_end_of_backward, _grad_views, _hand_off)
"""How every plan ends: compute waits for the side streams (the end-of-backward callback starts at
the first wait), then the final gradient is exposed and handed over on compute."""
_SYNC_PROLOGUE: tuple[Stage, ...] = (_inputs, _to_post_backward_stream, _merge_pending_unsharded, _cast_to_reduce_dtype)
_FINALIZE: tuple[Stage, ...] = (_cast_to_grad_dtype, _accumulate_or_offload, *_END_OF_BACKWARD)

PLAN_BUILDERS: Mapping[ShardingStrategy, tuple[Stage, ...]] = MappingProxyType(
    {
        ShardingStrategy.NO_SHARD: (*_SYNC_PROLOGUE, _all_reduce_no_shard, *_FINALIZE),
        ShardingStrategy.FULL_SHARD: (*_SYNC_PROLOGUE, _pad_to_shards, _reduce_scatter, _post_divide, *_FINALIZE),
        ShardingStrategy.SHARD_GRAD_OP: (*_SYNC_PROLOGUE, _pad_to_shards, _reduce_scatter, _post_divide, *_FINALIZE),
        ShardingStrategy.HYBRID_SHARD: (
            *_SYNC_PROLOGUE,
            _pad_to_shards,
            _reduce_scatter,
            _replicate_all_reduce,
            *_FINALIZE,
        ),
        ShardingStrategy.HYBRID_SHARD_ZERO2: (
            *_SYNC_PROLOGUE,
            _pad_to_shards,
            _reduce_scatter,
            _replicate_all_reduce,
            *_FINALIZE,
        ),
    }
)
"""Strategy -> the stages of its plan when gradients are synchronised. Read-only."""

_PER_PARAM_PROLOGUE: tuple[Stage, ...] = (_inputs, _to_post_backward_stream, _merge_pending_unsharded, _copy_in)

_PER_PARAM_SHARD: tuple[Stage, ...] = (*_PER_PARAM_PROLOGUE, _reduce_scatter, _post_divide, _all_reduce_hook)
_PER_PARAM_HYBRID: tuple[Stage, ...] = (*_PER_PARAM_PROLOGUE, _reduce_scatter, _replicate_all_reduce, _all_reduce_hook)

PER_PARAM_BUILDERS: Mapping[ShardingStrategy, tuple[Stage, ...]] = MappingProxyType(
    {
        ShardingStrategy.FULL_SHARD: (*_PER_PARAM_SHARD, *_FINALIZE),
        ShardingStrategy.SHARD_GRAD_OP: (*_PER_PARAM_SHARD, *_FINALIZE),
        ShardingStrategy.HYBRID_SHARD: (*_PER_PARAM_HYBRID, *_FINALIZE),
        ShardingStrategy.HYBRID_SHARD_ZERO2: (*_PER_PARAM_HYBRID, *_FINALIZE),
    }
)
"""Strategy -> the stages of a per-parameter (``fully_shard``) unit's plan when gradients are
synchronised: ``PLAN_BUILDERS``' with the copy-in for the cast and pad, and the all-reduce
hook's call where the unit has one. Read-only."""

NO_SYNC_STAGES: tuple[Stage, ...] = (_inputs, _merge_pending_unsharded, *_END_OF_BACKWARD)
"""The stages inside ``no_sync()``: accumulate locally, communicate nothing (both layouts)."""


def plan_stages(request: PlanRequest) -> tuple[Stage, ...]:
    """The stages of ``request``'s plan: by layout and strategy, or ``no_sync``'s."""
    if not request.flags.sync_gradients:
        return NO_SYNC_STAGES
    builders = PER_PARAM_BUILDERS if request.per_param else PLAN_BUILDERS
    return builders[request.sharding.strategy]


def build_plan(request: PlanRequest) -> Plan:
    """The plan for ``request``: pure, deterministic, and equal for equal requests."""
    grad = Buffer(name="grad", numel=request.layout.total_numel, dtype=request.compute_dtype)
    start = Draft(request=request, ops=(), grad=grad, stream=Stream.COMPUTE)
    done: Draft = pipe(start, *plan_stages(request))
    return Plan(request=request, ops=done.ops, factors=done.factors)


def plan_post_backward(
    layout: FlatParamLayout | PerParamLayout,
    sharding: ShardingSpec,
    *,
    mixed_precision: MixedPrecision = MixedPrecision(),
    offload: CPUOffload = CPUOffload(),
    comm_hook: CommHook = CommHook.NONE,
    division: Division = Division(),
    use_orig_params: bool = False,
    flags: StepFlags = StepFlags(),
    hybrid_all_reduce: HybridAllReduce = HybridAllReduce.ASYNC,
    reshard_after_backward: bool | None = None,
    all_reduce_hook: bool = False,
) -> Plan:
    """The gradient post-processing of one unit (a flat parameter or a per-parameter group) for
    one backward, as a ``Plan``.

    Raises ``ValueError``/``TypeError`` naming the argument when the combination is invalid.
    """
    request = PlanRequest(
        layout=layout,
        sharding=sharding,
        mixed_precision=mixed_precision,
        offload=offload,
        comm_hook=comm_hook,
        division=division,
        use_orig_params=use_orig_params,
        flags=flags,
        hybrid_all_reduce=hybrid_all_reduce,
        reshard_after_backward=reshard_after_backward,
        all_reduce_hook=all_reduce_hook,
    )
    return build_plan(request)


class PlanCache:
    """Plans by request, built once: what the shell consults on every backward.

    With ``verify`` every plan is proved sound by ``check_plan`` when it is first built (a
    cache miss), and an unsound one raises ``UnsoundPlanError`` instead of being returned, so
    verification costs nothing per step. Owned by whoever plans (one per FSDP root), so the
    core keeps no global state.
    """

    def __init__(self, maxsize: int = 4096, *, verify: bool = False) -> None:
        build = _build_verified if verify else build_plan
        self._get: functools._lru_cache_wrapper[Plan] = functools.lru_cache(maxsize=maxsize)(build)

    def __call__(self, request: PlanRequest) -> Plan:
        """The plan for ``request``, from the cache when it was built before."""
        return self._get(request)

    @property
    def hits(self) -> int:
        """Lookups answered from the cache."""
        return self._get.cache_info().hits

    @property
    def misses(self) -> int:
        """Plans built (and, with ``verify``, checked)."""
        return self._get.cache_info().misses


class UnsoundPlanError(RuntimeError):
    """A plan the verifier rejects; ``problems`` lists why."""

    def __init__(self, plan: Plan, problems: list[Problem]) -> None:
        self.plan = plan
        self.problems = tuple(problems)
        listed = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"the plan for {plan.request.sharding.strategy.name} is unsound:\n{listed}")


def _build_verified(request: PlanRequest) -> Plan:
    plan = build_plan(request)
    problems = check_plan(plan)
    if problems:
        raise UnsoundPlanError(plan, problems)
    return plan
