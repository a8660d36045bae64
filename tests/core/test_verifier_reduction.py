"""The verifier catches every class of wrong reduction or division: a gradient reduced twice or
not over every group, divided by the wrong total, by zero or twice, scaled inside a collective
over one rank, or gradients reduced differently added together.

Each test takes a sound plan (built by the planner, or written out op by op, from
``verifier_cases``) and breaks it in one specific way: an op dropped, two ops swapped, one op
replaced. It then asserts that ``check_plan`` reports the ``Rule`` for that class of bug.
"""

from __future__ import annotations

import dataclasses

import pytest

from fsdp_core import (
    Accumulate,
    AllReduce,
    CommHook,
    CommHookCall,
    Divide,
    EndOfBackwardWait,
    Free,
    HandOff,
    Op,
    RecordStream,
    ReduceKind,
    ReduceOpSpec,
    ReduceScatter,
    Rule,
    ShardingStrategy,
    StepFlags,
    Stream,
    check_plan,
)
from tests.core.verifier_cases import (
    FULL,
    HYBRID,
    HYBRID2,
    NCCL_AVG,
    NO_SHARD,
    drop,
    find,
    found,
    insert,
    is_buffer,
    make_plan,
    op_at,
    replace_at,
    with_ops,
)

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
