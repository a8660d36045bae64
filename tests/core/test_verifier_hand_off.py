"""The verifier catches every class of wrong input or hand-off: a carried gradient dropped or
never read, no hand-off or two, an op after it, the wrong stream, dtype, device or destination,
and ``use_orig_params`` views missing, of another rank or buffer, or exposed too early.

Each test takes a sound plan (built by the planner, or written out op by op, from
``verifier_cases``) and breaks it in one specific way: an op dropped, two ops swapped, one op
replaced. It then asserts that ``check_plan`` reports the ``Rule`` for that class of bug.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp_core import (
    Accumulate,
    Cast,
    Destination,
    Device,
    EndOfBackwardWait,
    FlatParamLayout,
    Free,
    GradViews,
    HandOff,
    Input,
    InputRole,
    MixedPrecision,
    Offload,
    Op,
    Plan,
    Rule,
    ShardingStrategy,
    StepFlags,
    Stream,
)
from tests.core.verifier_cases import (
    FULL,
    HYBRID,
    MULTI,
    drop,
    find,
    found,
    insert,
    make_plan,
    op_at,
    problems,
    replace_at,
    rules,
    swap,
    with_ops,
)

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
    layout = plan.request.layout
    assert isinstance(layout, FlatParamLayout)
    rank0 = plan.request.sharding.shard_views(layout, 0)
    assert rank0 != op.views
    found(replace_at(plan, g, dataclasses.replace(op, views=rank0)), Rule.VIEWS, at=g, says="do not match")


def test_views_unsharded_in_a_sharded_plan() -> None:
    """Rule VIEWS: views of the whole flat parameter do not fit in a shard."""
    plan = orig_plan()
    g = find(plan, GradViews)
    op = op_at(plan, g, GradViews)
    broken = replace_at(plan, g, dataclasses.replace(op, views=plan.request.unsharded_views()))
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


# -- gaps found while writing these tests, since closed ---------------------------------------------------


@pytest.mark.parametrize("strategy", [FULL, HYBRID])
def test_dropped_gradient_new_shard_never_accumulated(strategy: ShardingStrategy) -> None:
    """Rule DROPPED_GRADIENT: the Accumulate into the existing sharded gradient is dropped, so
    this backward's gradient is reduced, then thrown away."""
    plan = make_plan(strategy, flags=StepFlags(accumulate=True))
    broken = drop(plan, find(plan, Accumulate))
    assert Rule.DROPPED_GRADIENT in rules(broken)
