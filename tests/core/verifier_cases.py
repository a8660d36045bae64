"""Sound plans and the edits that break them, shared by the verifier's tests (``test_verifier_*.py``).

``make_plan`` builds a planner plan; ``war_plan`` writes a FULL_SHARD plan out op by op;
``drop``, ``swap``, ``replace_at``, ``insert`` and ``substitute`` break a plan in one specific
way; ``found`` returns the problem of a ``Rule`` that ``check_plan`` reports, or fails listing
every problem it reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TypeVar

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
    WaitStream,
    check_plan,
    divide_factors,
    plan_post_backward,
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


# -- a hand-written plan ----------------------------------------------------------------


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
