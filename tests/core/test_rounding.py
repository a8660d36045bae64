"""The rounding bound of a step's plans (``fsdp_core.plan.rounding``), worked out by hand.

``U`` is float32's unit roundoff (2**-24), ``UB`` bfloat16's (2**-8), ``UH`` float16's (2**-11);
``EH`` is float16's underflow error (half its smallest subnormal, 2**-25). Each expected value
counts the roundings on the longest path of a term through the printed plan.
"""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_core import (
    CommHook,
    CPUOffload,
    FlatParamLayout,
    MixedPrecision,
    Plan,
    ReduceKind,
    ReduceOpSpec,
    ShardingSpec,
    ShardingStrategy,
    StepFlags,
    plan_post_backward,
)
from fsdp_core.plan.rounding import Rounding, plan_rounding, step_rounding, unit_roundoff, widens_exactly

U, UB, UH, U64 = 2.0**-24, 2.0**-8, 2.0**-11, 2.0**-53
EH = 2.0**-25
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
LAYOUT = FlatParamLayout.of([("w", (10,)), ("b", (3,))], F32)
BF16_FP32 = MixedPrecision(param_dtype=BF16, reduce_dtype=F32)


def plan(
    strategy: ShardingStrategy, world: int, shard: int | None = None, flags: StepFlags = StepFlags(), **kw: object
) -> Plan:
    return plan_post_backward(LAYOUT, ShardingSpec.for_world(strategy, world, shard), flags=flags, **kw)  # type: ignore[arg-type]  # the keywords of plan_post_backward


def test_unit_roundoffs_and_exact_casts() -> None:
    assert [unit_roundoff(d) for d in (F32, BF16, F16, torch.float64)] == [U, UB, UH, U64]
    assert widens_exactly(BF16, F32) and widens_exactly(F16, F32) and widens_exactly(F32, F32)
    assert not widens_exactly(F32, BF16)
    assert not widens_exactly(BF16, F16), "bfloat16's range is wider than float16's"
    assert not widens_exactly(F16, BF16), "float16 has more mantissa bits than bfloat16"


def test_collectives_by_hand() -> None:
    start = Rounding(0.0, 0.0)
    assert start.reduced(4, F32, ReduceOpSpec()).roundoffs == 3 * U  # three additions
    assert start.reduced(4, F32, ReduceOpSpec(kind=ReduceKind.AVG)).roundoffs == 4 * U  # and a division
    assert start.reduced(4, F32, ReduceOpSpec(kind=ReduceKind.PREMUL_SUM, premul=0.25)).roundoffs == 4 * U
    fp16_sum = Rounding(0.0, EH).reduced(4, F16, ReduceOpSpec())
    assert fp16_sum.underflow == 4 * EH + 3 * EH  # every rank's error, and one per addition
    assert start.divided(1.0, F32) == start, "dividing by 1 rounds nothing"
    assert start.plus(Rounding(3 * U, 0.0), BF16).roundoffs == 3 * U + UB  # the longer path, then the sum


def test_bound_is_relative_to_the_terms_plus_the_underflow() -> None:
    r = Rounding(2 * U, 1e-30)
    assert r.relative == math.expm1(2 * U)
    assert r.bound(3.0) == math.expm1(2 * U) * 3.0 + math.exp(2 * U) * 1e-30


@pytest.mark.parametrize(
    ("strategy", "world", "shard", "roundoffs"),
    [
        # divide /2, reduce-scatter over 2: one addition
        (ShardingStrategy.FULL_SHARD, 2, None, 2 * U),
        # divide /4, reduce-scatter over 8: seven additions, divide /2
        (ShardingStrategy.FULL_SHARD, 8, None, 9 * U),
        # divide /2, all-reduce over 4: three additions, divide /2
        (ShardingStrategy.NO_SHARD, 4, None, 5 * U),
        # divide /2, reduce-scatter over the shard group of 2, all-reduce over the 2 replicas, divide /2
        (ShardingStrategy.HYBRID_SHARD, 4, 2, 4 * U),
    ],
)
def test_one_synchronising_backward_in_float32(
    strategy: ShardingStrategy, world: int, shard: int | None, roundoffs: float
) -> None:
    r = plan_rounding(plan(strategy, world, shard))
    assert r is not None and r.roundoffs == roundoffs


def test_bfloat16_reduction_rounds_in_bfloat16_and_casts_back_exactly() -> None:
    r = plan_rounding(plan(ShardingStrategy.FULL_SHARD, 2, mixed_precision=MixedPrecision(param_dtype=BF16)))
    assert r is not None and r.roundoffs == 2 * UB  # divide and one addition in bfloat16; to float32 exact


def test_no_sync_accumulates_in_the_compute_dtype_before_reducing_in_float32() -> None:
    quiet = plan(ShardingStrategy.FULL_SHARD, 2, mixed_precision=BF16_FP32, flags=StepFlags(sync_gradients=False))
    assert plan_rounding(quiet) == Rounding(), "inside no_sync the gradient is handed on unrounded"
    last = plan(ShardingStrategy.FULL_SHARD, 2, mixed_precision=BF16_FP32, flags=StepFlags(pending_unsharded=True))
    r = step_rounding([quiet, last])
    # pending += grad in bfloat16, cast to float32 (exact), divide /2, one addition
    assert r.roundoffs == UB + 2 * U
    assert r.underflow == pytest.approx(2.0**-134 + 2 * 2.0**-150)


def test_fp16_compress_hook_rounds_every_step_on_the_wire() -> None:
    r = plan_rounding(plan(ShardingStrategy.FULL_SHARD, 4, comm_hook=CommHook.FP16_COMPRESS))
    # cast to float16, pre-divide, three additions, post-divide; back to float32 exact
    assert r is not None and r.roundoffs == 6 * UH
    # cast and pre-divide on each of 4 ranks (2 EH each), 3 additions, the post-divide
    assert r.underflow == pytest.approx(4 * 2 * EH + 3 * EH + EH)


def test_offload_copies_exactly() -> None:
    r = plan_rounding(plan(ShardingStrategy.FULL_SHARD, 2, offload=CPUOffload(offload_params=True)))
    assert r is not None and r.roundoffs == 2 * U


def test_a_user_hook_has_no_bound() -> None:
    with pytest.raises(ValueError, match="user comm hook's arithmetic is not part of the plan"):
        plan_rounding(plan(ShardingStrategy.FULL_SHARD, 2, comm_hook=CommHook.USER))


def test_a_step_must_end_synchronised() -> None:
    quiet = plan(ShardingStrategy.FULL_SHARD, 2, flags=StepFlags(sync_gradients=False))
    with pytest.raises(ValueError, match=r"plans: the optimizer's gradient is not whole .*pending_unsharded"):
        step_rounding([quiet])
    with pytest.raises(ValueError, match="carried: the plan takes a pending_unsharded gradient, but only none"):
        plan_rounding(plan(ShardingStrategy.FULL_SHARD, 2, flags=StepFlags(pending_unsharded=True)))


def test_deferred_hybrid_all_reduce_carries_the_partial_reduction() -> None:
    deferred = plan(ShardingStrategy.HYBRID_SHARD, 4, 2, flags=StepFlags(requires_all_reduce=False))
    with pytest.raises(ValueError, match="pending_partial"):
        step_rounding([deferred])
    last = plan(ShardingStrategy.HYBRID_SHARD, 4, 2, flags=StepFlags(pending_partial=True))
    r = step_rounding([deferred, last])
    assert r.roundoffs > plan_rounding(plan(ShardingStrategy.HYBRID_SHARD, 4, 2)).roundoffs  # type: ignore[union-attr]  # a synchronising plan hands off
