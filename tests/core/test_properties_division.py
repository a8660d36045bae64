"""(d) Every plan divides the gradient by the data-parallel size (or the user's factor) in total,
over random requests, and the division policy (``fsdp_core.spec.division``) worked out by hand:
FSDP1's pre-divide factor, averaging inside the collectives, the fp16 split near the square root,
user factors. Requests are drawn by ``properties_cases``. Expected values are written out here,
never computed with the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given

from fsdp_core import (
    AllReduce,
    BackendCaps,
    CommHook,
    CommHookCall,
    Destination,
    Divide,
    DivideFactors,
    Division,
    DivisionPolicy,
    FlatParamLayout,
    Group,
    Plan,
    PlanRequest,
    ReduceKind,
    ReduceOpSpec,
    ReduceScatter,
    ShardingSpec,
    ShardingStrategy,
    build_plan,
    check_plan,
    divide_factors,
    fsdp1_predivide_factor,
    plan_post_backward,
)
from fsdp_core.plan.verifier import expected_destination
from tests.core.properties_cases import CI, requests

# -- (d) division --------------------------------------------------------------------------


def applied_division(plan: Plan) -> float:
    """What the plan's ops divide the gradient by: Divide factors over the collectives' scales."""
    sizes = {Group.SHARD: plan.request.sharding.shard_size, Group.REPLICATE: plan.request.sharding.replicate_size}
    divided = 1.0
    for op in plan.ops:
        if isinstance(op, Divide):
            divided *= op.factor
        elif isinstance(op, (ReduceScatter, AllReduce)):
            divided /= op.reduce_op.scale(sizes[op.group])
        elif isinstance(op, CommHookCall):
            divided *= op.divides_by
    return divided


@CI
@given(requests())
def test_division_factors_multiply_to_the_data_parallel_size(request: PlanRequest) -> None:
    plan = build_plan(request)
    sharding = request.sharding
    dp = sharding.shard_size * sharding.replicate_size
    total = float(dp) if request.division.factor is None else request.division.factor
    destination = expected_destination(request)
    factors = plan.factors
    if destination is Destination.UNSHARDED_GRAD:
        assert factors is None
        assert applied_division(plan) == 1.0
        return
    if request.comm_hook is not CommHook.NONE:
        assert factors is None
        shard_group = float(sharding.shard_size)
        expected = shard_group if destination is Destination.PARTIAL else float(dp)
        assert math.isclose(applied_division(plan), expected, rel_tol=1e-9)
        return
    assert factors is not None
    assert factors.total == total
    rs_scale = factors.reduce_scatter_op.scale(sharding.shard_size)
    ar_scale = factors.all_reduce_op.scale(sharding.replicate_size)
    assert math.isclose(factors.pre * factors.post / (rs_scale * ar_scale), total, rel_tol=1e-9)
    if destination is Destination.PARTIAL:
        assert math.isclose(applied_division(plan), factors.pre / rs_scale, rel_tol=1e-9)
    else:
        assert math.isclose(applied_division(plan), total, rel_tol=1e-9)


# -- fsdp_core.spec.division, by hand -----------------------------------------------------------


@pytest.mark.parametrize(
    "world, factor",
    [
        (1, 1),  # 1/1 > 1 fails at once
        (2, 2),  # 1 -> 2 (2 > 1); 2/2 = 1 > 2 fails
        (3, 2),  # 1 -> 2; 3 % 2 != 0 stops
        (4, 2),  # 1 -> 2; 4/2 = 2 > 2 fails
        (6, 4),  # 1 -> 2; 6/2 = 3 > 2 -> 4; 6 % 4 != 0 stops (4 does not divide 6, as in FSDP1)
        (8, 4),  # 1 -> 2 -> 4 (8/2 = 4 > 2); 8/4 = 2 > 4 fails
        (12, 4),  # 1 -> 2 -> 4 (12/2 = 6 > 2); 12/4 = 3 > 4 fails
        (16, 4),  # 1 -> 2 -> 4 (16/2 = 8 > 2); 16/4 = 4 > 4 fails
        (32, 8),  # 1 -> 2 -> 4 -> 8 (32/4 = 8 > 4); 32/8 = 4 > 8 fails
        (1024, 32),  # ... -> 32 (1024/16 = 64 > 16); 1024/32 = 32 > 32 fails
    ],
)
def test_fsdp1_predivide_factor(world: int, factor: int) -> None:
    assert fsdp1_predivide_factor(world) == factor


SUM = ReduceOpSpec()
AVG = ReduceOpSpec(kind=ReduceKind.AVG)
NCCL = BackendCaps(supports_avg=True, supports_premul_sum=True)
GLOO = BackendCaps()


def factors_of(dp: int, dtype: torch.dtype, division: Division, replicate: int = 1) -> DivideFactors:
    return divide_factors(shard_size=dp // replicate, replicate_size=replicate, reduce_dtype=dtype, division=division)


@pytest.mark.parametrize(
    "dp, pre, post",
    [(1, 1.0, 1.0), (2, 2.0, 1.0), (6, 4.0, 1.5), (8, 4.0, 2.0), (32, 8.0, 4.0), (1024, 32.0, 32.0)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pre_post_is_fsdp1_whatever_the_dtype(dp: int, pre: float, post: float, dtype: torch.dtype) -> None:
    got = factors_of(dp, dtype, Division(policy=DivisionPolicy.PRE_POST, backend=NCCL))
    assert got == DivideFactors(pre=pre, post=post, reduce_scatter_op=SUM, all_reduce_op=SUM, total=float(dp))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_in_collective_nccl_averages_on_both_groups(dtype: torch.dtype) -> None:
    got = factors_of(32, dtype, Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL), replicate=4)
    assert got == DivideFactors(pre=1.0, post=1.0, reduce_scatter_op=AVG, all_reduce_op=AVG, total=32.0)
    assert AVG.scale(8) == 0.125 and AVG.scale(4) == 0.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_collective_gloo_divides_after(dtype: torch.dtype) -> None:
    got = factors_of(8, dtype, Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO))
    assert got == DivideFactors(pre=1.0, post=8.0, reduce_scatter_op=SUM, all_reduce_op=SUM, total=8.0)


@pytest.mark.parametrize("backend", [NCCL, GLOO], ids=["nccl", "gloo"])
def test_in_collective_fp16_splits_near_sqrt(backend: BackendCaps) -> None:
    got = factors_of(32, torch.float16, Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=backend))
    assert got == DivideFactors(pre=8.0, post=4.0, reduce_scatter_op=SUM, all_reduce_op=SUM, total=32.0)


def test_user_factor_with_premul_sum() -> None:
    got = factors_of(8, torch.float32, Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=3.0))
    premul = ReduceOpSpec(kind=ReduceKind.PREMUL_SUM, premul=1.0 / 3.0)
    assert got == DivideFactors(pre=1.0, post=1.0, reduce_scatter_op=premul, all_reduce_op=SUM, total=3.0)
    assert str(premul) == "premul_sum(0.333333)"


@pytest.mark.parametrize("replicate", [1, 4])
def test_user_factor_over_a_shard_group_of_one_divides_after(replicate: int) -> None:
    """No PREMUL_SUM on a group of one rank (NCCL copies; see ``divide_factors``)."""
    got = factors_of(
        replicate,
        torch.float32,
        Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=3.0),
        replicate=replicate,
    )
    assert got == DivideFactors(pre=1.0, post=3.0, reduce_scatter_op=SUM, all_reduce_op=SUM, total=3.0)


@pytest.mark.parametrize(("dp", "replicate", "rs", "ar"), [(4, 4, SUM, AVG), (4, 1, AVG, SUM), (8, 2, AVG, AVG)])
def test_average_only_over_groups_of_more_than_one_rank(
    dp: int, replicate: int, rs: ReduceOpSpec, ar: ReduceOpSpec
) -> None:
    got = factors_of(
        dp, torch.bfloat16, Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL), replicate=replicate
    )
    assert got == DivideFactors(pre=1.0, post=1.0, reduce_scatter_op=rs, all_reduce_op=ar, total=float(dp))


def test_user_factor_without_premul_sum_divides_after() -> None:
    got = factors_of(8, torch.float32, Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO, factor=3.0))
    assert got == DivideFactors(pre=1.0, post=3.0, reduce_scatter_op=SUM, all_reduce_op=SUM, total=3.0)


def test_user_factor_pre_post() -> None:
    # 6 is an integer: pre is FSDP1's factor for 6 (4), post the rest (1.5)
    assert factors_of(8, torch.float32, Division(factor=6.0)) == DivideFactors(
        pre=4.0, post=1.5, reduce_scatter_op=SUM, all_reduce_op=SUM, total=6.0
    )
    # 2.5 is not: all of it after
    assert factors_of(8, torch.float32, Division(factor=2.5)) == DivideFactors(
        pre=1.0, post=2.5, reduce_scatter_op=SUM, all_reduce_op=SUM, total=2.5
    )
    # fp16 in collective with a user factor of 3: split 2 / 1.5
    assert factors_of(8, torch.float16, Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=3.0)) == (
        DivideFactors(pre=2.0, post=1.5, reduce_scatter_op=SUM, all_reduce_op=SUM, total=3.0)
    )


@pytest.mark.parametrize("backend", [NCCL, GLOO], ids=["nccl", "gloo"])
@pytest.mark.parametrize("policy", list(DivisionPolicy))
def test_data_parallel_size_one_divides_nothing(policy: DivisionPolicy, backend: BackendCaps) -> None:
    got = factors_of(1, torch.float32, Division(policy=policy, backend=backend))
    assert got == DivideFactors(pre=1.0, post=1.0, reduce_scatter_op=SUM, all_reduce_op=SUM, total=1.0)


def test_reduce_op_spec_and_backend_validation() -> None:
    assert SUM.scale(8) == 1.0
    assert ReduceOpSpec(kind=ReduceKind.PREMUL_SUM, premul=0.25).scale(8) == 0.25
    with pytest.raises(ValueError, match="premul"):
        ReduceOpSpec(kind=ReduceKind.SUM, premul=2.0)
    with pytest.raises(ValueError, match="premul"):
        ReduceOpSpec(kind=ReduceKind.PREMUL_SUM, premul=0.0)
    assert BackendCaps.for_backend("NCCL") == NCCL
    assert BackendCaps.for_backend("gloo") == GLOO
    with pytest.raises(ValueError, match="backend"):
        BackendCaps.for_backend("mpi")
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="divide_factor"):
            Division(factor=bad)


def test_tiny_user_factor_is_refused_at_construction_or_plans() -> None:
    layout = FlatParamLayout.of([("w", (16,))], torch.float32)
    sharding = ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 8)
    try:
        division = Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=1e-310)
    except ValueError:
        return
    assert check_plan(plan_post_backward(layout, sharding, division=division)) == []


def test_hybrid_comm_hook_with_premul_only_backend_divides_fully() -> None:
    """HYBRID_SHARD 2 x 2, allreduce hook (averages over the shard group of 2), IN_COLLECTIVE
    division on a backend with PREMUL_SUM and no AVG: the replicate all-reduce must still divide
    by 2, for a total of 4. The plan all-reduces with SUM and divides by nothing."""
    layout = FlatParamLayout.of([("w", (4,))], torch.float32)
    division = Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=BackendCaps(supports_premul_sum=True))
    plan = plan_post_backward(
        layout,
        ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 4, 2),
        comm_hook=CommHook.ALLREDUCE,
        division=division,
    )
    assert math.isclose(applied_division(plan), 4.0)
    assert check_plan(plan) == []
