"""The verifier catches every class of broken plan.

Each test takes a sound plan (built by the planner, or written out op by op) and breaks it in
one specific way: an op dropped, two ops swapped, one op replaced. It then asserts that
``check_plan`` reports the ``Rule`` for that class of bug. The sound plans themselves must
produce no problems at all, or every finding here would be noise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from fsdp_core import (
    Accumulate,
    AllReduce,
    BackendCaps,
    Buffer,
    Cast,
    CommHook,
    CommHookCall,
    CPUOffload,
    Destination,
    Device,
    Divide,
    Division,
    DivisionPolicy,
    EndOfBackwardWait,
    FlatParamLayout,
    Free,
    FreeUnshardedParam,
    GradViews,
    Group,
    HandOff,
    Input,
    InputRole,
    MixedPrecision,
    Offload,
    Op,
    Pad,
    Plan,
    PlanCache,
    PlanRequest,
    Problem,
    RecordStream,
    ReduceKind,
    ReduceOpSpec,
    ReduceScatter,
    Rule,
    ShardingSpec,
    ShardingStrategy,
    StepFlags,
    Stream,
    UnsoundPlanError,
    WaitStream,
    check_plan,
    divide_factors,
    plan_post_backward,
    unsharded_views,
)

FULL = ShardingStrategy.FULL_SHARD
ZERO2 = ShardingStrategy.SHARD_GRAD_OP
NO_SHARD = ShardingStrategy.NO_SHARD
HYBRID = ShardingStrategy.HYBRID_SHARD
HYBRID2 = ShardingStrategy.HYBRID_SHARD_ZERO2

LAYOUT = FlatParamLayout.of([("w", (1001,))], torch.float32)
"""1001 elements: not a multiple of 8, so sharded plans pad to 1008 (shard 126)."""

MULTI = FlatParamLayout.of([("a.weight", (7, 9)), ("a.bias", (7,)), ("b.weight", (5, 3))], torch.float32, align=True)
"""Several parameters with 16-byte alignment, as ``use_orig_params`` lays them out."""

NCCL_AVG = Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=BackendCaps.for_backend("nccl"))

T = TypeVar("T")


# -- building and editing plans ------------------------------------------------------------


def make_plan(
    strategy: ShardingStrategy = FULL,
    *,
    world: int = 8,
    shard: int | None = None,
    rank: int = 0,
    layout: FlatParamLayout = LAYOUT,
    mp: MixedPrecision = MixedPrecision(),
    offload: bool = False,
    hook: CommHook = CommHook.NONE,
    division: Division = Division(),
    use_orig_params: bool = False,
    flags: StepFlags = StepFlags(),
) -> Plan:
    """A planner plan; hybrid strategies default to shards of 8 in a world of 32."""
    if strategy.is_hybrid and shard is None:
        world, shard = 32, 8
    return plan_post_backward(
        layout,
        ShardingSpec.for_world(strategy, world, shard, rank=rank),
        mixed_precision=mp,
        offload=CPUOffload(offload_params=offload),
        comm_hook=hook,
        division=division,
        use_orig_params=use_orig_params,
        flags=flags,
    )


def with_ops(plan: Plan, ops: Iterable[Op]) -> Plan:
    """``plan`` with its ops replaced (same request and factors)."""
    return Plan(request=plan.request, ops=tuple(ops), factors=plan.factors)


def find(plan: Plan, kind: type[T], where: Callable[[T], bool] = lambda _: True) -> int:
    """The index of the one op of type ``kind`` matching ``where``."""
    hits = [i for i, op in enumerate(plan.ops) if isinstance(op, kind) and where(op)]
    assert len(hits) == 1, f"expected one {kind.__name__} matching, found at {hits}"
    return hits[0]


def op_at(plan: Plan, index: int, kind: type[T]) -> T:
    """The op at ``index``, checked to be a ``kind``."""
    op = plan.ops[index]
    assert isinstance(op, kind)
    return op


def drop(plan: Plan, *indices: int) -> Plan:
    """``plan`` without the ops at ``indices``."""
    gone = set(indices)
    return with_ops(plan, (op for i, op in enumerate(plan.ops) if i not in gone))


def swap(plan: Plan, i: int, j: int) -> Plan:
    """``plan`` with the ops at ``i`` and ``j`` exchanged."""
    ops = list(plan.ops)
    ops[i], ops[j] = ops[j], ops[i]
    return with_ops(plan, ops)


def replace_at(plan: Plan, index: int, *new: Op) -> Plan:
    """``plan`` with the op at ``index`` replaced by ``new`` (zero or more ops)."""
    return with_ops(plan, plan.ops[:index] + new + plan.ops[index + 1 :])


def insert(plan: Plan, index: int, *new: Op) -> Plan:
    """``plan`` with ``new`` inserted before the op at ``index``."""
    return with_ops(plan, plan.ops[:index] + new + plan.ops[index:])


def substitute(op: Op, old: Buffer, new: Buffer) -> Op:
    """``op`` with every mention of the buffer ``old`` replaced by ``new``."""

    def sub(b: Buffer) -> Buffer:
        return new if b == old else b

    match op:
        case Input() | RecordStream() | Free() | Divide() | AllReduce() | GradViews() | HandOff():
            return dataclasses.replace(op, buffer=sub(op.buffer))
        case Cast() | Pad() | ReduceScatter() | CommHookCall() | Accumulate() | Offload():
            return dataclasses.replace(op, src=sub(op.src), dst=sub(op.dst))
        case _:
            return op


def problems(plan: Plan) -> list[Problem]:
    return check_plan(plan)


def rules(plan: Plan) -> set[Rule]:
    return {p.rule for p in check_plan(plan)}


def found(plan: Plan, rule: Rule, *, at: int | None = None, says: str = "") -> Problem:
    """The first problem of ``rule`` (at op ``at``, mentioning ``says``); fail, listing all
    problems, when there is none."""
    all_problems = check_plan(plan)
    for p in all_problems:
        if p.rule is rule and (at is None or p.op_index == at) and says in p.message:
            return p
    listing = "\n".join(str(p) for p in all_problems) or "(no problems)"
    raise AssertionError(f"expected a {rule.value} problem at {at} saying {says!r}; got:\n{listing}")


def is_buffer(name: str) -> Callable[[RecordStream | Free | Divide | AllReduce | HandOff | GradViews], bool]:
    return lambda op: op.buffer.name == name


# -- sound baselines -----------------------------------------------------------------------

SOUND: dict[str, Callable[[], Plan]] = {
    "full_shard": lambda: make_plan(FULL),
    "shard_grad_op": lambda: make_plan(ZERO2),
    "no_shard": lambda: make_plan(NO_SHARD),
    "hybrid": lambda: make_plan(HYBRID),
    "hybrid_zero2": lambda: make_plan(HYBRID2),
    "hybrid_accumulate": lambda: make_plan(HYBRID, flags=StepFlags(accumulate=True)),
    "hybrid_bf16": lambda: make_plan(HYBRID, mp=MixedPrecision(param_dtype=torch.bfloat16)),
    "hybrid_deferred": lambda: make_plan(HYBRID, flags=StepFlags(requires_all_reduce=False)),
    "hybrid_pending_partial": lambda: make_plan(HYBRID, flags=StepFlags(pending_partial=True)),
    "full_shard_fp16_offload_orig": lambda: make_plan(
        FULL, layout=MULTI, mp=MixedPrecision(param_dtype=torch.float16), offload=True, use_orig_params=True
    ),
    "full_shard_offload_accumulate": lambda: make_plan(FULL, offload=True, flags=StepFlags(accumulate=True)),
    "full_shard_nccl_avg": lambda: make_plan(FULL, division=NCCL_AVG),
    "full_shard_user_factor": lambda: make_plan(FULL, division=dataclasses.replace(NCCL_AVG, factor=3.0)),
    "full_shard_hook": lambda: make_plan(FULL, hook=CommHook.FP16_COMPRESS),
    "hybrid_hook": lambda: make_plan(HYBRID, hook=CommHook.BF16_COMPRESS),
    "no_shard_hook": lambda: make_plan(NO_SHARD, hook=CommHook.ALLREDUCE),
    "no_sync": lambda: make_plan(FULL, flags=StepFlags(sync_gradients=False)),
    "no_sync_pending": lambda: make_plan(ZERO2, flags=StepFlags(sync_gradients=False, pending_unsharded=True)),
    "pending_unsharded": lambda: make_plan(FULL, flags=StepFlags(pending_unsharded=True, accumulate=True)),
    "hybrid_orig_params": lambda: make_plan(HYBRID, layout=MULTI, use_orig_params=True),
    "orig_params_rank3": lambda: make_plan(FULL, layout=MULTI, rank=3, use_orig_params=True),
}


@pytest.mark.parametrize("name", sorted(SOUND))
def test_sound_baselines_have_no_problems(name: str) -> None:
    assert problems(SOUND[name]()) == []


def war_plan(*, with_hazard: bool) -> Plan:
    """A hand-written FULL_SHARD plan over 2 ranks, 4 elements, averaging in the collective.

    With ``with_hazard``, the compute stream scales ``grad`` in place right after the
    reduce-scatter was enqueued on the post-backward stream, which may still be reading it.
    """
    layout = FlatParamLayout.of([("w", (4,))], torch.float32)
    request = PlanRequest(layout=layout, sharding=ShardingSpec.for_world(FULL, 2), division=NCCL_AVG)
    grad = Buffer(name="grad", numel=4, dtype=torch.float32)
    shard = Buffer(name="shard", numel=2, dtype=torch.float32)
    avg = ReduceOpSpec(kind=ReduceKind.AVG)
    hazard: tuple[Op, ...] = (Divide(buffer=grad, factor=2.0, stream=Stream.COMPUTE),) if with_hazard else ()
    ops: tuple[Op, ...] = (
        FreeUnshardedParam(stream=Stream.COMPUTE),
        Input(buffer=grad, role=InputRole.GRAD, stream=Stream.COMPUTE),
        WaitStream(stream=Stream.POST_BACKWARD, waits_for=Stream.COMPUTE),
        ReduceScatter(src=grad, dst=shard, group=Group.SHARD, reduce_op=avg, stream=Stream.POST_BACKWARD),
        *hazard,
        RecordStream(buffer=grad, stream=Stream.POST_BACKWARD),
        Free(buffer=grad, stream=Stream.COMPUTE),
        EndOfBackwardWait(stream=Stream.COMPUTE, waits_for=Stream.POST_BACKWARD),
        HandOff(buffer=shard, destination=Destination.SHARDED_GRAD, stream=Stream.COMPUTE),
    )
    factors = divide_factors(shard_size=2, replicate_size=1, reduce_dtype=torch.float32, division=NCCL_AVG)
    return Plan(request=request, ops=ops, factors=factors)


def test_hand_written_plan_is_sound() -> None:
    assert problems(war_plan(with_hazard=False)) == []


# -- buffer lifetimes ----------------------------------------------------------------------


def test_use_before_write_dropped_input() -> None:
    """Rule USE_BEFORE_WRITE: the gradient's Input is gone, so the Pad reads nothing."""
    plan = make_plan(FULL)
    broken = drop(plan, find(plan, Input))
    p = found(broken, Rule.USE_BEFORE_WRITE, says="grad is used before anything produces it")
    assert isinstance(broken.ops[p.op_index], Pad)


def test_use_before_write_reduce_before_pad() -> None:
    """Rule USE_BEFORE_WRITE: the reduce-scatter is moved ahead of the Pad that produces its input."""
    plan = make_plan(FULL)
    rs = find(plan, ReduceScatter)
    pad = find(plan, Pad)
    broken = with_ops(
        plan, (*plan.ops[:pad], plan.ops[rs], *(op for i, op in enumerate(plan.ops) if i >= pad and i != rs))
    )
    found(broken, Rule.USE_BEFORE_WRITE, at=pad, says="grad.padded")


def test_use_after_free() -> None:
    """Rule USE_AFTER_FREE: the padded gradient is freed before the reduce-scatter reads it."""
    plan = make_plan(FULL)
    rs = find(plan, ReduceScatter)
    free = find(plan, Free, is_buffer("grad.padded"))
    assert free == rs + 1
    found(swap(plan, rs, free), Rule.USE_AFTER_FREE, at=free, says="grad.padded is used after it was freed")


def test_redefined_while_alive() -> None:
    """Rule REDEFINED: the Pad runs twice, producing grad.padded again while it is alive."""
    plan = make_plan(FULL)
    pad = find(plan, Pad)
    found(insert(plan, pad, plan.ops[pad]), Rule.REDEFINED, says="grad.padded is produced again")


def test_leak_dropped_free() -> None:
    """Rule LEAK: the padded gradient is never freed nor handed off."""
    plan = make_plan(FULL)
    broken = drop(plan, find(plan, Free, is_buffer("grad.padded")))
    p = found(broken, Rule.LEAK, says="grad.padded is neither freed nor handed off")
    assert p.op_index == -1


# -- streams -------------------------------------------------------------------------------


def test_unsynced_stream_hybrid_without_all_reduce_wait() -> None:
    """Rule UNSYNCED_STREAM: the all-reduce stream does not wait for the reduce-scatter that
    produced the shard it all-reduces."""
    plan = make_plan(HYBRID)
    wait = find(plan, WaitStream, lambda op: op.stream is Stream.ALL_REDUCE and op.waits_for is Stream.POST_BACKWARD)
    broken = drop(plan, wait)
    ar = find(broken, AllReduce)
    found(broken, Rule.UNSYNCED_STREAM, at=ar, says="shard is used on all_reduce but was last written on post_backward")


def test_unsynced_stream_post_backward_without_wait() -> None:
    """Rule UNSYNCED_STREAM: the post-backward stream reads the gradient without waiting for
    the compute stream that produced it."""
    plan = make_plan(FULL)
    broken = drop(plan, find(plan, WaitStream))
    found(broken, Rule.UNSYNCED_STREAM, at=find(broken, Pad), says="grad is used on post_backward")


def test_unsynced_stream_hand_off_without_end_of_backward_wait() -> None:
    """Rule UNSYNCED_STREAM: the optimizer (compute stream) takes the shard without waiting
    for the all-reduce stream that finished it."""
    plan = make_plan(HYBRID)
    broken = drop(plan, find(plan, EndOfBackwardWait, lambda op: op.waits_for is Stream.ALL_REDUCE))
    found(broken, Rule.UNSYNCED_STREAM, at=find(broken, HandOff), says="shard is used on compute")


@pytest.mark.parametrize(
    "flags, mp",
    [
        (StepFlags(accumulate=True), MixedPrecision()),
        (StepFlags(), MixedPrecision(param_dtype=torch.bfloat16)),
    ],
    ids=["accumulate", "bf16_cast_back"],
)
@pytest.mark.parametrize("strategy", [HYBRID, HYBRID2])
def test_unsafe_reuse_hybrid_shard_without_record_stream(
    strategy: ShardingStrategy, flags: StepFlags, mp: MixedPrecision
) -> None:
    """Rule UNSAFE_REUSE, the cross-layer aliasing bug of PyTorch PRs 179443/180900: the shard
    the reduce-scatter allocated on the post-backward stream is read on the all-reduce stream
    and then freed to the post-backward pool; without record_stream, the next layer's
    reduce-scatter may reuse its memory while the all-reduce still reads it."""
    plan = make_plan(strategy, flags=flags, mp=mp)
    assert problems(plan) == []
    record = find(plan, RecordStream, lambda op: op.buffer.name == "shard" and op.stream is Stream.ALL_REDUCE)
    broken = drop(plan, record)
    free = find(broken, Free, is_buffer("shard"))
    assert op_at(broken, free, Free).stream is Stream.POST_BACKWARD
    p = found(broken, Rule.UNSAFE_REUSE, at=free, says="freed to post_backward's pool while work on all_reduce")
    assert "shard" in str(p)
    assert rules(broken) == {Rule.UNSAFE_REUSE}


def test_unsafe_reuse_unsharded_grad_without_record_stream() -> None:
    """Rule UNSAFE_REUSE: the compute stream frees the gradient while the post-backward
    stream's Pad may still read it."""
    plan = make_plan(FULL)
    broken = drop(plan, find(plan, RecordStream, is_buffer("grad")))
    found(broken, Rule.UNSAFE_REUSE, at=find(broken, Free, is_buffer("grad")), says="grad is freed to compute's pool")


def test_unsafe_reuse_write_after_read() -> None:
    """Rule UNSAFE_REUSE (write-after-read): the compute stream writes ``grad`` in place while
    the post-backward stream's reduce-scatter may still be reading it."""
    broken = war_plan(with_hazard=True)
    divide = find(broken, Divide)
    p = found(broken, Rule.UNSAFE_REUSE, at=divide, says="grad is written on compute while a read on post_backward")
    assert [q.rule for q in problems(broken)] == [Rule.UNSAFE_REUSE]
    assert str(p).startswith(f"[unsafe_reuse] op {divide}: grad ")


def test_unsafe_reuse_free_on_wrong_stream() -> None:
    """Rule UNSAFE_REUSE: a buffer allocated on the post-backward stream is freed on compute."""
    plan = make_plan(FULL)
    free = find(plan, Free, is_buffer("grad.padded"))
    wrong = dataclasses.replace(op_at(plan, free, Free), stream=Stream.COMPUTE)
    found(
        replace_at(plan, free, wrong),
        Rule.UNSAFE_REUSE,
        at=free,
        says="grad.padded is freed on compute but was allocated on post_backward",
    )


# -- dtypes, numels, devices ---------------------------------------------------------------


def test_dtype_mismatch_reduce_scatter() -> None:
    """Rule DTYPE_MISMATCH: the reduce-scatter writes a bf16 shard from an fp32 input."""
    plan = make_plan(FULL)
    rs = find(plan, ReduceScatter)
    op = op_at(plan, rs, ReduceScatter)
    bad = dataclasses.replace(op, dst=dataclasses.replace(op.dst, dtype=torch.bfloat16))
    found(replace_at(plan, rs, bad), Rule.DTYPE_MISMATCH, at=rs, says="differ in dtype")


def test_numel_mismatch_reduce_scatter() -> None:
    """Rule NUMEL_MISMATCH: the reduce-scatter's input is not group size x its output."""
    plan = make_plan(FULL)
    rs = find(plan, ReduceScatter)
    op = op_at(plan, rs, ReduceScatter)
    bad = dataclasses.replace(op, dst=dataclasses.replace(op.dst, numel=op.dst.numel + 1))
    found(replace_at(plan, rs, bad), Rule.NUMEL_MISMATCH, at=rs, says="must be 8 x output")


def test_reduce_scatter_input_smaller_than_flat_parameter() -> None:
    """Rule REDUCTION: a hand-written plan without the Pad reduce-scatters a truncated gradient
    (floor(1001 / 8) * 8 = 1000 elements): the last element would never be reduced."""
    plan = make_plan(FULL, division=NCCL_AVG)
    grad = Buffer(name="grad", numel=1001, dtype=torch.float32)
    truncated = Buffer(name="grad", numel=1000, dtype=torch.float32)
    shard = Buffer(name="shard", numel=125, dtype=torch.float32)
    avg = ReduceOpSpec(kind=ReduceKind.AVG)
    broken = with_ops(
        plan,
        (
            FreeUnshardedParam(stream=Stream.COMPUTE),
            Input(buffer=grad, role=InputRole.GRAD, stream=Stream.COMPUTE),
            WaitStream(stream=Stream.POST_BACKWARD, waits_for=Stream.COMPUTE),
            ReduceScatter(src=truncated, dst=shard, group=Group.SHARD, reduce_op=avg, stream=Stream.POST_BACKWARD),
            RecordStream(buffer=grad, stream=Stream.POST_BACKWARD),
            Free(buffer=grad, stream=Stream.COMPUTE),
            EndOfBackwardWait(stream=Stream.COMPUTE, waits_for=Stream.POST_BACKWARD),
            HandOff(buffer=shard, destination=Destination.SHARDED_GRAD, stream=Stream.COMPUTE),
        ),
    )
    found(broken, Rule.REDUCTION, at=3, says="smaller than the flat parameter (1001)")


def test_numel_mismatch_pad_shrinks() -> None:
    """Rule NUMEL_MISMATCH: a Pad whose output is smaller than its input."""
    plan = make_plan(FULL)
    pad = find(plan, Pad)
    op = op_at(plan, pad, Pad)
    bad = dataclasses.replace(op, dst=dataclasses.replace(op.dst, numel=1000))
    found(replace_at(plan, pad, bad), Rule.NUMEL_MISMATCH, at=pad, says="pad shrinks")


def test_dtype_mismatch_accumulate() -> None:
    """Rule DTYPE_MISMATCH: accumulating a bf16 shard into the fp32 sharded gradient (the cast
    back is missing)."""
    plan = make_plan(FULL, mp=MixedPrecision(param_dtype=torch.bfloat16), flags=StepFlags(accumulate=True))
    cast = find(plan, Cast, lambda op: op.dst.name == "shard.fp32")
    cast_op = op_at(plan, cast, Cast)
    acc = find(plan, Accumulate)
    acc_op = op_at(plan, acc, Accumulate)
    edited: list[Op] = []
    for i, op in enumerate(plan.ops):
        if i == cast or (isinstance(op, Free) and op.buffer.name == cast_op.src.name):
            continue
        if i == acc:
            edited.append(dataclasses.replace(acc_op, src=cast_op.src))
        elif isinstance(op, Free) and op.buffer == cast_op.dst:
            edited.append(dataclasses.replace(op, buffer=cast_op.src))
        else:
            edited.append(op)
    broken = with_ops(plan, edited)
    found(broken, Rule.DTYPE_MISMATCH, says="accumulate shard[126:bfloat16] into sharded_grad[126:float32]")


def test_device_mismatch_cast_to_host() -> None:
    """Rule DEVICE_MISMATCH: a Cast silently moves the shard to host memory."""
    plan = make_plan(FULL, mp=MixedPrecision(param_dtype=torch.float16))
    cast = find(plan, Cast, lambda op: op.dst.name == "shard.fp32")
    op = op_at(plan, cast, Cast)
    bad = dataclasses.replace(op, dst=dataclasses.replace(op.dst, device=Device.HOST))
    found(replace_at(plan, cast, bad), Rule.DEVICE_MISMATCH, at=cast, says="crosses devices outside an offload")


def test_buffer_disagrees_with_its_producer() -> None:
    """Rule DTYPE_MISMATCH: a later op names the shard with another dtype than it was produced in."""
    plan = make_plan(FULL)
    divide = find(plan, Divide, is_buffer("shard"))
    op = op_at(plan, divide, Divide)
    bad = dataclasses.replace(op, buffer=dataclasses.replace(op.buffer, dtype=torch.float16))
    found(replace_at(plan, divide, bad), Rule.DTYPE_MISMATCH, at=divide, says="disagrees with how it was produced")


# -- reduction and division ----------------------------------------------------------------


@pytest.mark.parametrize("strategy", [NO_SHARD, HYBRID, HYBRID2])
def test_reduced_twice(strategy: ShardingStrategy) -> None:
    """Rule REDUCTION: the all-reduce is duplicated, so the gradient is summed twice over one group."""
    plan = make_plan(strategy)
    ar = find(plan, AllReduce)
    broken = insert(plan, ar + 1, plan.ops[ar])
    p = found(broken, Rule.REDUCTION, at=ar + 1, says="a second time")
    assert "over the" in p.message


def test_hybrid_missing_replicate_all_reduce() -> None:
    """Rule REDUCTION: a hybrid plan without the replicate all-reduce hands off a gradient
    reduced only within its shard group."""
    plan = make_plan(HYBRID)
    broken = drop(plan, find(plan, AllReduce))
    found(broken, Rule.REDUCTION, at=find(broken, HandOff), says="expected exactly once over {replicate")


@pytest.mark.parametrize("strategy", [FULL, NO_SHARD, HYBRID])
def test_dropped_divide(strategy: ShardingStrategy) -> None:
    """Rule DIVISION: the pre-divide is gone, so the total division falls short."""
    plan = make_plan(strategy)
    first = next(i for i, op in enumerate(plan.ops) if isinstance(op, Divide))
    broken = drop(plan, first)
    total = 32 if strategy.is_hybrid else 8
    p = found(broken, Rule.DIVISION, says=f"expected {total}")
    assert p.op_index == find(broken, HandOff)


def test_divide_by_wrong_factor() -> None:
    """Rule DIVISION: the post-divide is by 3 instead of 2 (total 12 instead of 8)."""
    plan = make_plan(FULL)
    post = find(plan, Divide, is_buffer("shard"))
    op = op_at(plan, post, Divide)
    assert op.factor == 2.0
    broken = replace_at(plan, post, dataclasses.replace(op, factor=3.0))
    found(broken, Rule.DIVISION, says="divided by 12 in total, expected 8")


def test_divide_by_zero() -> None:
    """Rule DIVISION: a divide by zero is never a valid division."""
    plan = make_plan(FULL)
    post = find(plan, Divide, is_buffer("shard"))
    broken = replace_at(plan, post, dataclasses.replace(op_at(plan, post, Divide), factor=0.0))
    found(broken, Rule.DIVISION, at=post, says="divide by 0")


def test_divided_twice_in_collective_and_after() -> None:
    """Rule DIVISION: averaging in the collective and dividing after as well divides twice."""
    plan = make_plan(FULL, division=NCCL_AVG)
    assert not any(isinstance(op, Divide) for op in plan.ops)
    shard = op_at(plan, find(plan, ReduceScatter), ReduceScatter).dst
    broken = insert(plan, find(plan, EndOfBackwardWait), Divide(buffer=shard, factor=8.0, stream=Stream.POST_BACKWARD))
    found(broken, Rule.DIVISION, says="divided by 64 in total, expected 8")


@pytest.mark.parametrize("strategy", [FULL, NO_SHARD])
def test_scaling_collective_over_one_rank(strategy: ShardingStrategy) -> None:
    """Rule DIVISION: a user factor of 3 put into a collective over a group of one rank as
    PREMUL_SUM(1/3), as the planner did before a GPU showed that NCCL returns such a
    reduce-scatter's input undivided. The planner divides outside it instead."""
    division = dataclasses.replace(NCCL_AVG, factor=3.0)
    plan = make_plan(strategy, world=1, division=division)
    assert check_plan(plan) == []
    post = find(plan, Divide)
    assert op_at(plan, post, Divide).factor == 3.0
    premul = ReduceOpSpec(kind=ReduceKind.PREMUL_SUM, premul=1.0 / 3.0)
    broken = with_ops(plan, [op for i, op in enumerate(plan.ops) if i != post])
    if strategy is FULL:
        at = find(broken, ReduceScatter)
        broken = replace_at(broken, at, dataclasses.replace(op_at(broken, at, ReduceScatter), reduce_op=premul))
    else:
        at = find(broken, AllReduce)
        broken = replace_at(broken, at, dataclasses.replace(op_at(broken, at, AllReduce), reduce_op=premul))
    found(broken, Rule.DIVISION, at=at, says="group of one rank with premul_sum(0.333333)")


def test_comm_hook_divides_by_wrong_group_size() -> None:
    """Rule DIVISION: the hook is told to average over 4 ranks in a group of 8."""
    plan = make_plan(FULL, hook=CommHook.FP16_COMPRESS)
    call = find(plan, CommHookCall)
    broken = replace_at(plan, call, dataclasses.replace(op_at(plan, call, CommHookCall), divides_by=4))
    found(broken, Rule.DIVISION, at=call, says="divides by 4 but its group has 8 ranks")


def test_accumulate_differently_reduced_buffers() -> None:
    """Rule REDUCTION: in a hybrid accumulation step, the new shard is added into the existing
    (fully reduced) sharded gradient before its replicate all-reduce."""
    plan = make_plan(HYBRID, flags=StepFlags(accumulate=True))
    acc = find(plan, Accumulate)
    acc_op = op_at(plan, acc, Accumulate)
    rs = find(plan, ReduceScatter)
    early = dataclasses.replace(acc_op, stream=Stream.POST_BACKWARD)
    broken = insert(drop(plan, acc), rs + 1, early)
    p = found(broken, Rule.REDUCTION, at=rs + 1, says="mixes differently reduced gradients")
    assert "shard" in p.message and "sharded_grad" in p.message


def test_pending_partial_added_after_all_reduce() -> None:
    """Rule REDUCTION: a partial reduction kept from an earlier backward is added after the
    replicate all-reduce instead of before it, so its contribution is never all-reduced."""
    plan = make_plan(HYBRID, flags=StepFlags(pending_partial=True))
    acc = find(plan, Accumulate)
    acc_op = op_at(plan, acc, Accumulate)
    assert acc_op.src.name == "partial"
    free_partial = find(plan, Free, is_buffer("partial"))
    free_op = op_at(plan, free_partial, Free)
    moved = drop(plan, acc, free_partial)
    ar = find(moved, AllReduce)
    late: tuple[Op, ...] = (
        dataclasses.replace(acc_op, stream=Stream.ALL_REDUCE),
        RecordStream(buffer=acc_op.src, stream=Stream.ALL_REDUCE),
        free_op,
    )
    broken = insert(moved, ar + 1, *late)
    found(broken, Rule.REDUCTION, at=ar + 1, says="mixes differently reduced gradients")


# -- inputs and hand-off -------------------------------------------------------------------


def test_dropped_gradient_missing_sharded_grad_input() -> None:
    """Rule DROPPED_GRADIENT: with accumulate=True, a plan that never takes the existing
    sharded gradient would lose it."""
    good = make_plan(FULL, flags=StepFlags(accumulate=True))
    without = make_plan(FULL)
    broken = with_ops(good, without.ops)
    found(broken, Rule.DROPPED_GRADIENT, at=-1, says="never takes the sharded_grad input")


def test_dropped_gradient_input_never_read() -> None:
    """Rule DROPPED_GRADIENT: the existing sharded gradient is declared but only freed, never read."""
    good = make_plan(FULL, flags=StepFlags(accumulate=True))
    saved = op_at(good, find(good, Input, lambda op: op.role is InputRole.SHARDED_GRAD), Input)
    without = make_plan(FULL)
    grad_input = find(without, Input)
    edited = insert(without, grad_input + 1, saved)
    broken = with_ops(
        good, insert(edited, find(edited, EndOfBackwardWait), Free(buffer=saved.buffer, stream=Stream.COMPUTE)).ops
    )
    found(broken, Rule.DROPPED_GRADIENT, at=-1, says="input sharded_grad is never read")


def test_dropped_gradient_unexpected_input() -> None:
    """Rule DROPPED_GRADIENT: a plan takes a pending-partial input the flags do not provide."""
    good = make_plan(HYBRID)
    other = make_plan(HYBRID, flags=StepFlags(pending_partial=True))
    found(with_ops(good, other.ops), Rule.DROPPED_GRADIENT, says="takes a pending_partial input")


def test_no_hand_off() -> None:
    """Rule HAND_OFF: without a hand-off the optimizer never sees the gradient."""
    plan = make_plan(FULL)
    found(drop(plan, find(plan, HandOff)), Rule.HAND_OFF, at=-1, says="found 0")


def test_two_hand_offs() -> None:
    """Rule HAND_OFF: two hand-offs (and the second comes after the first)."""
    plan = make_plan(FULL)
    h = find(plan, HandOff)
    broken = insert(plan, h, plan.ops[h])
    found(broken, Rule.HAND_OFF, at=-1, says="found 2")
    found(broken, Rule.HAND_OFF, at=h + 1, says="hand_off comes after the hand-off")


def test_op_after_hand_off() -> None:
    """Rule HAND_OFF: an end-of-backward wait moved after the hand-off."""
    plan = make_plan(FULL)
    h = find(plan, HandOff)
    broken = swap(plan, h - 1, h)
    found(broken, Rule.HAND_OFF, at=h, says="end_of_backward_wait comes after the hand-off")


def test_hand_off_on_side_stream() -> None:
    """Rule HAND_OFF: the optimizer runs on compute, so the hand-off must be there."""
    plan = make_plan(FULL)
    h = find(plan, HandOff)
    bad = dataclasses.replace(op_at(plan, h, HandOff), stream=Stream.POST_BACKWARD)
    found(replace_at(plan, h, bad), Rule.HAND_OFF, at=h, says="hands off on post_backward")


def _skip_cast_back(plan: Plan) -> Plan:
    """``plan`` (with a cast of the shard back to fp32) handing off the low-precision shard."""
    cast = find(plan, Cast, lambda op: op.dst.name == "shard.fp32")
    cast_op = op_at(plan, cast, Cast)
    edited: list[Op] = []
    for i, op in enumerate(plan.ops):
        if i == cast or (isinstance(op, Free) and op.buffer == cast_op.src):
            continue
        if isinstance(op, HandOff):
            edited.append(dataclasses.replace(op, buffer=cast_op.src))
        else:
            edited.append(op)
    return with_ops(plan, edited)


@pytest.mark.parametrize("strategy", [FULL, HYBRID])
def test_hand_off_wrong_dtype(strategy: ShardingStrategy) -> None:
    """Rule DTYPE_MISMATCH: under bf16 mixed precision the cast back to fp32 is missing."""
    plan = make_plan(strategy, mp=MixedPrecision(param_dtype=torch.bfloat16))
    broken = _skip_cast_back(plan)
    p = found(broken, Rule.DTYPE_MISMATCH, at=find(broken, HandOff), says="the optimizer expects torch.float32")
    assert "shard[126:bfloat16]" in str(p)
    # keep_low_precision_grads asks for exactly that plan
    keep = make_plan(strategy, mp=MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True))
    assert problems(with_ops(keep, broken.ops)) == []


def test_hand_off_wrong_device() -> None:
    """Rule DEVICE_MISMATCH: offload was requested but the shard stays on the device."""
    plan = make_plan(FULL, offload=True)
    offload = find(plan, Offload)
    shard = op_at(plan, offload, Offload).src
    edited: list[Op] = []
    for i, op in enumerate(plan.ops):
        if i == offload or (isinstance(op, Free) and op.buffer == shard):
            continue
        edited.append(dataclasses.replace(op, buffer=shard) if isinstance(op, HandOff) else op)
    broken = with_ops(plan, edited)
    found(broken, Rule.DEVICE_MISMATCH, at=find(broken, HandOff), says="on device, expected host")


def test_offload_to_device_memory() -> None:
    """Rule DEVICE_MISMATCH: an Offload whose destination is not host memory."""
    plan = make_plan(FULL, offload=True)
    offload = find(plan, Offload)
    op = op_at(plan, offload, Offload)
    bad = dataclasses.replace(op, dst=dataclasses.replace(op.dst, device=Device.DEVICE))
    found(replace_at(plan, offload, bad), Rule.DEVICE_MISMATCH, at=offload, says="device memory to host memory")


@pytest.mark.parametrize(
    "flags, wrong",
    [
        (StepFlags(), Destination.ACCUMULATED_GRAD),
        (StepFlags(accumulate=True), Destination.SHARDED_GRAD),
        (StepFlags(sync_gradients=False), Destination.SHARDED_GRAD),
    ],
)
def test_hand_off_wrong_destination(flags: StepFlags, wrong: Destination) -> None:
    """Rule HAND_OFF: the destination disagrees with what the step flags ask for."""
    plan = make_plan(FULL, flags=flags)
    h = find(plan, HandOff)
    bad = dataclasses.replace(op_at(plan, h, HandOff), destination=wrong)
    found(replace_at(plan, h, bad), Rule.HAND_OFF, at=h, says=f"hands off to {wrong.value}")


# -- use_orig_params views -----------------------------------------------------------------


def orig_plan(rank: int = 1) -> Plan:
    return make_plan(FULL, world=4, rank=rank, layout=MULTI, use_orig_params=True)


def test_views_missing() -> None:
    """Rule VIEWS: use_orig_params without grad views leaves the original .grad unset."""
    plan = orig_plan()
    found(drop(plan, find(plan, GradViews)), Rule.VIEWS, at=-1, says="exactly one grad_views op, found 0")


def test_views_of_another_rank() -> None:
    """Rule VIEWS: rank 1's plan exposes rank 0's slices."""
    plan = orig_plan(rank=1)
    g = find(plan, GradViews)
    op = op_at(plan, g, GradViews)
    rank0 = plan.request.sharding.shard_views(plan.request.layout, 0)
    assert rank0 != op.views
    found(replace_at(plan, g, dataclasses.replace(op, views=rank0)), Rule.VIEWS, at=g, says="do not match")


def test_views_unsharded_in_a_sharded_plan() -> None:
    """Rule VIEWS: views of the whole flat parameter do not fit in a shard."""
    plan = orig_plan()
    g = find(plan, GradViews)
    op = op_at(plan, g, GradViews)
    broken = replace_at(plan, g, dataclasses.replace(op, views=unsharded_views(plan.request.layout)))
    found(broken, Rule.VIEWS, at=g, says="lies outside shard")


def test_views_of_wrong_buffer() -> None:
    """Rule VIEWS: the views point into a buffer other than the one handed off."""
    plan = make_plan(
        FULL, world=4, rank=1, layout=MULTI, use_orig_params=True, mp=MixedPrecision(param_dtype=torch.float16)
    )
    g = find(plan, GradViews)
    op = op_at(plan, g, GradViews)
    handed = op_at(plan, find(plan, HandOff), HandOff).buffer
    assert op.buffer == handed
    cast = find(plan, Cast, lambda c: c.dst == handed)
    low = op_at(plan, cast, Cast).src
    moved = drop(plan, g)
    broken = insert(moved, cast, dataclasses.replace(op, buffer=low))
    found(broken, Rule.VIEWS, says=f"views are of {low.name} but {handed.name} is handed off")


def test_views_on_a_side_stream() -> None:
    """Rule VIEWS: the views are exposed on the post-backward stream."""
    plan = orig_plan()
    g = find(plan, GradViews)
    broken = replace_at(plan, g, dataclasses.replace(op_at(plan, g, GradViews), stream=Stream.POST_BACKWARD))
    found(broken, Rule.VIEWS, at=g, says="exposed on post_backward")


def test_views_inside_the_hook() -> None:
    """Rule VIEWS: the views are exposed before the end-of-backward waits (where the planner
    once put them, on the post-backward stream)."""
    plan = orig_plan()
    g = find(plan, GradViews)
    wait = find(plan, EndOfBackwardWait)
    assert wait == g - 1
    early = dataclasses.replace(op_at(plan, g, GradViews), stream=Stream.POST_BACKWARD)
    broken = insert(drop(plan, g), wait, early)
    found(broken, Rule.VIEWS, at=wait, says="inside the post-backward hook")
    found(broken, Rule.VIEWS, at=wait, says="exposed on post_backward")


def test_views_without_use_orig_params() -> None:
    """Rule VIEWS: grad views in a plan that did not ask for them."""
    with_views = orig_plan()
    plain = make_plan(FULL, world=4, rank=1, layout=MULTI)
    broken = with_ops(plain, with_views.ops)
    found(broken, Rule.VIEWS, says="grad views without use_orig_params")


# -- problem rendering ---------------------------------------------------------------------


def test_problem_str_is_readable_and_names_the_buffer() -> None:
    plan = make_plan(HYBRID, flags=StepFlags(accumulate=True))
    broken = drop(plan, find(plan, RecordStream, lambda op: op.buffer.name == "shard"))
    [p] = problems(broken)
    text = str(p)
    assert text.startswith(f"[unsafe_reuse] op {p.op_index}: shard ")
    assert "all_reduce" in text and "post_backward" in text
    assert "\n" not in text

    leak = drop(plan, find(plan, Free, is_buffer("grad.padded")))
    [q] = problems(leak)
    assert str(q) == "[leak] plan: grad.padded is neither freed nor handed off"


def test_every_rule_is_exercised() -> None:
    """Every Rule the verifiers can report appears in at least one test: ``check_plan``'s in this
    file, ``check_unshard``'s in ``test_unshard.py``."""
    here = Path(__file__)
    source = here.read_text(encoding="utf-8") + here.with_name("test_unshard.py").read_text(encoding="utf-8")
    missing = [r.name for r in Rule if f"Rule.{r.name}" not in source]
    assert missing == []


# -- gaps found while writing these tests, since closed ---------------------------------------------------


@pytest.mark.parametrize("strategy", [FULL, HYBRID])
def test_dropped_gradient_new_shard_never_accumulated(strategy: ShardingStrategy) -> None:
    """Rule DROPPED_GRADIENT: the Accumulate into the existing sharded gradient is dropped, so
    this backward's gradient is reduced, then thrown away."""
    plan = make_plan(strategy, flags=StepFlags(accumulate=True))
    broken = drop(plan, find(plan, Accumulate))
    assert Rule.DROPPED_GRADIENT in rules(broken)


@pytest.mark.parametrize("change", ["numel", "dtype"])
def test_gradient_input_disagrees_with_layout(change: str) -> None:
    """Rule NUMEL_MISMATCH / DTYPE_MISMATCH: the plan declares the autograd gradient with 1000
    elements for a 1001-element flat parameter (or in fp16 for an fp32 compute dtype)."""
    plan = make_plan(FULL)
    grad = op_at(plan, find(plan, Input), Input).buffer
    wrong = (
        dataclasses.replace(grad, numel=1000) if change == "numel" else dataclasses.replace(grad, dtype=torch.float16)
    )
    edited = [substitute(op, grad, wrong) for op in plan.ops]
    if change == "dtype":
        pad = next(i for i, op in enumerate(edited) if isinstance(op, Pad))
        pad_op = edited[pad]
        assert isinstance(pad_op, Pad)
        fp32 = Buffer(name="grad.fp32", numel=grad.numel, dtype=torch.float32)
        edited[pad : pad + 1] = [
            Cast(src=wrong, dst=fp32, stream=Stream.POST_BACKWARD),
            dataclasses.replace(pad_op, src=fp32),
            Free(buffer=fp32, stream=Stream.POST_BACKWARD),
        ]
    broken = with_ops(plan, edited)
    expected = Rule.NUMEL_MISMATCH if change == "numel" else Rule.DTYPE_MISMATCH
    assert expected in rules(broken)


def test_full_shard_plan_that_never_reshards() -> None:
    plan = make_plan(FULL)
    assert plan.should_free_in_backward
    broken = drop(plan, find(plan, FreeUnshardedParam))
    assert Rule.RESHARD in rules(broken)


def test_verifying_cache_checks_each_plan_once_and_refuses_unsound_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the shell consults on every backward: a miss builds and verifies, a hit returns the
    same plan; a plan the verifier rejects raises with its problems instead of being returned."""
    import fsdp_core.plan.planner as planner

    plan = make_plan(HYBRID)
    cache = PlanCache(verify=True)
    assert cache(plan.request) is cache(plan.request) and (cache.misses, cache.hits) == (1, 1)

    broken = dataclasses.replace(plan, ops=drop(plan, find(plan, AllReduce)).ops)
    monkeypatch.setattr(planner, "build_plan", lambda request: broken)
    with pytest.raises(UnsoundPlanError) as caught:
        PlanCache(verify=True)(plan.request)
    assert caught.value.plan is broken
    assert any(p.rule is Rule.REDUCTION for p in caught.value.problems)
    assert PlanCache()(plan.request) is broken
