"""The verifier catches every class of broken buffer lifetime and stream order: a buffer used
before it is written or after it is freed, produced twice, leaked, read on a stream that did not
wait for its producer, or freed while another stream may still use it.

Each test takes a sound plan (built by the planner, or written out op by op, from
``verifier_cases``) and breaks it in one specific way: an op dropped, two ops swapped, one op
replaced. It then asserts that ``check_plan`` reports the ``Rule`` for that class of bug.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp_core import (
    AllReduce,
    Divide,
    EndOfBackwardWait,
    Free,
    FreeUnshardedParam,
    HandOff,
    Input,
    MixedPrecision,
    Pad,
    RecordStream,
    ReduceScatter,
    Rule,
    ShardingStrategy,
    StepFlags,
    Stream,
    WaitStream,
)
from tests.core.verifier_cases import (
    FULL,
    HYBRID,
    HYBRID2,
    drop,
    find,
    found,
    insert,
    is_buffer,
    make_plan,
    op_at,
    problems,
    replace_at,
    rules,
    swap,
    war_plan,
    with_ops,
)

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


# -- gaps found while writing these tests, since closed ---------------------------------------------------


def test_full_shard_plan_that_never_reshards() -> None:
    plan = make_plan(FULL)
    assert plan.should_free_in_backward
    broken = drop(plan, find(plan, FreeUnshardedParam))
    assert Rule.RESHARD in rules(broken)
