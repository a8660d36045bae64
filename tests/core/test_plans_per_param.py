"""Exact plans of per-parameter (``fully_shard``) units, every op written out by hand, and what a
per-parameter request refuses.

The unit: ``w`` (5, 3) and ``b`` (5,), both sharded on dimension 0 over 2 ranks. Each parameter
is chunked as ``torch.chunk`` does: 3 rows per rank, rank 1 holds the last 2. Padded shards are
9 and 3 elements, so one rank's slice is 12, the reduce-scatter input 24 (2 slices), and the
unsharded gradients 15 + 5 = 20 elements. Rank 0's views: ``w`` at 0 (9 elements, its rows 0-2),
``b`` at 9 (3); rank 1's: ``w`` at 0 (6 elements: rows 3-4, which start at element 9 of ``w``),
``b`` at 9 (2 elements from element 3).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from fsdp_core import (
    Accumulate,
    AllReduce,
    AllReduceHookCall,
    Cast,
    CommHook,
    CopyIn,
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
    PerParamLayout,
    PlanRequest,
    RecordStream,
    ReduceScatter,
    Rule,
    ShardingSpec,
    ShardingStrategy,
    ShardView,
    StepFlags,
    WaitStream,
    check_plan,
    comm_volume,
    plan_post_backward,
)
from fsdp_core.plan.render import format_plan
from tests.core.test_plans_exact import AR, BF16, F32, PB, SUM, C, buf

GLOO_FSDP2 = Division(policy=DivisionPolicy.IN_COLLECTIVE)
"""FSDP2's division on a backend without AVG: sum, then divide."""
UNIT = PerParamLayout.of([("w", (5, 3)), ("b", (5,))], F32, 2)
FULL = ShardingSpec(strategy=ShardingStrategy.FULL_SHARD, shard_size=2, rank=1)
HYBRID = ShardingSpec(strategy=ShardingStrategy.HYBRID_SHARD, shard_size=2, replicate_size=2, rank=0)
MIXED = MixedPrecision(param_dtype=BF16, reduce_dtype=F32)


def view(name: str, index: int, offset: int, in_param: int, numel: int) -> ShardView:
    return ShardView(param_index=index, param_name=name, offset_in_buffer=offset, offset_in_param=in_param, numel=numel)


RANK0 = (view("w", 0, 0, 0, 9), view("b", 1, 9, 0, 3))
RANK1 = (view("w", 0, 0, 9, 6), view("b", 1, 9, 3, 2))


def test_the_units_numbers() -> None:
    assert (UNIT.total_numel, UNIT.slice_numel, UNIT.padded_numel) == (20, 12, 24)
    request = PlanRequest(layout=UNIT, sharding=FULL)
    assert (request.shard_numel, request.padded_numel) == (12, 24)
    assert request.shard_views() == RANK1
    assert UNIT.shard_views(0) == RANK0


def test_full_shard_copies_in_reduce_scatters_and_exposes_each_parameters_shard() -> None:
    plan = plan_post_backward(UNIT, FULL, division=GLOO_FSDP2)
    grad, rs_in, shard = buf("grad", 20), buf("grad.in", 24), buf("shard", 12)
    assert plan.ops == (
        FreeUnshardedParam(stream=C),
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        WaitStream(stream=PB, waits_for=C),
        CopyIn(src=grad, dst=rs_in, layout=UNIT, stream=PB),
        RecordStream(buffer=grad, stream=PB),
        Free(buffer=grad, stream=C),
        ReduceScatter(src=rs_in, dst=shard, group=Group.SHARD, reduce_op=SUM, stream=PB),
        Free(buffer=rs_in, stream=PB),
        Divide(buffer=shard, factor=2.0, stream=PB),
        EndOfBackwardWait(stream=C, waits_for=PB),
        GradViews(buffer=shard, views=RANK1, stream=C),
        HandOff(buffer=shard, destination=Destination.SHARDED_GRAD, stream=C),
    )
    assert check_plan(plan) == []
    (rs,) = comm_volume(plan)
    assert (rs.input_numel, rs.output_numel, rs.bytes) == (24, 12, 1 * 12 * 4)
    shown = format_plan(plan)
    assert "per-parameter unit: 20 elements in 2 parameter(s), padded 24, shard 12" in shown
    assert "copy_in" in shown and "grad.in[24:float32]" in shown


def test_hybrid_bf16_compute_reduces_in_fp32_and_accumulates_into_the_existing_grad() -> None:
    plan = plan_post_backward(
        UNIT, HYBRID, mixed_precision=MIXED, division=GLOO_FSDP2, flags=StepFlags(accumulate=True)
    )
    grad, saved = buf("grad", 20, BF16), buf("sharded_grad", 12)
    rs_in, shard = buf("grad.in", 24), buf("shard", 12)
    assert plan.ops == (
        FreeUnshardedParam(stream=C),
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        Input(buffer=saved, role=InputRole.SHARDED_GRAD, stream=C),
        WaitStream(stream=PB, waits_for=C),
        CopyIn(src=grad, dst=rs_in, layout=UNIT, stream=PB),  # the cast to fp32 is the copy-in's
        RecordStream(buffer=grad, stream=PB),
        Free(buffer=grad, stream=C),
        ReduceScatter(src=rs_in, dst=shard, group=Group.SHARD, reduce_op=SUM, stream=PB),
        Free(buffer=rs_in, stream=PB),
        WaitStream(stream=AR, waits_for=PB),
        RecordStream(buffer=shard, stream=AR),
        AllReduce(buffer=shard, group=Group.REPLICATE, reduce_op=SUM, stream=AR),
        Divide(buffer=shard, factor=4.0, stream=AR),
        Accumulate(dst=saved, src=shard, stream=AR),
        Free(buffer=shard, stream=PB),
        EndOfBackwardWait(stream=C, waits_for=PB),
        EndOfBackwardWait(stream=C, waits_for=AR),
        GradViews(buffer=saved, views=RANK0, stream=C),
        HandOff(buffer=saved, destination=Destination.ACCUMULATED_GRAD, stream=C),
    )
    assert check_plan(plan) == []


def test_no_sync_keeps_the_unsharded_gradients_in_the_reduce_dtype() -> None:
    """FSDP2's ``unsharded_accumulated_grad``: without gradient sync a bf16 gradient is kept in
    the fp32 reduce dtype; ``reshard_after_backward=False`` keeps the unsharded parameters."""
    plan = plan_post_backward(
        UNIT, FULL, mixed_precision=MIXED, flags=StepFlags(sync_gradients=False), reshard_after_backward=False
    )
    grad, kept = buf("grad", 20, BF16), buf("grad.fp32", 20)
    assert plan.ops == (
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        Cast(src=grad, dst=kept, stream=C),
        Free(buffer=grad, stream=C),
        HandOff(buffer=kept, destination=Destination.UNSHARDED_GRAD, stream=C),  # .grad stays as it was
    )
    assert check_plan(plan) == []
    assert plan.carried_out is InputRole.PENDING_UNSHARDED


def test_the_synced_backward_after_no_sync_adds_into_the_fp32_accumulation_before_the_copy_in() -> None:
    plan = plan_post_backward(
        UNIT, FULL, mixed_precision=MIXED, division=GLOO_FSDP2, flags=StepFlags(pending_unsharded=True)
    )
    grad, pending, rs_in = buf("grad", 20, BF16), buf("grad.pending", 20), buf("grad.in", 24)
    assert plan.ops[:11] == (
        FreeUnshardedParam(stream=C),
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        Input(buffer=pending, role=InputRole.PENDING_UNSHARDED, stream=C),
        WaitStream(stream=PB, waits_for=C),
        Accumulate(dst=pending, src=grad, stream=PB),  # bf16 into fp32: the one widening add
        RecordStream(buffer=grad, stream=PB),
        Free(buffer=grad, stream=C),
        CopyIn(src=pending, dst=rs_in, layout=UNIT, stream=PB),
        RecordStream(buffer=pending, stream=PB),
        Free(buffer=pending, stream=C),
        ReduceScatter(src=rs_in, dst=buf("shard", 12), group=Group.SHARD, reduce_op=SUM, stream=PB),
    )
    assert check_plan(plan) == []
    assert plan.consumed == frozenset({InputRole.PENDING_UNSHARDED})


def test_a_shard_dimension_other_than_0_views_its_chunk_as_the_copy_in_stacks_it() -> None:
    """``v`` (4, 6) on dimension 1 over 2 ranks: 3 columns each, 12 elements; in the parameter
    with its chunks stacked first rank 1's chunk starts at element 12."""
    layout = PerParamLayout.of([("v", (4, 6), 1)], F32, 2)
    plan = plan_post_backward(layout, FULL, division=GLOO_FSDP2)
    (views,) = [op for op in plan.ops if isinstance(op, GradViews)]
    assert views.views == (view("v", 0, 0, 12, 12),)
    assert check_plan(plan) == []


def test_the_verifier_refuses_a_copy_in_laid_out_for_another_unit() -> None:
    plan = plan_post_backward(UNIT, FULL, division=GLOO_FSDP2)
    other = PerParamLayout.of([("w", (5, 3)), ("b", (4,))], F32, 2)  # 19 elements into 9 + 2, twice
    ops = tuple(dataclasses.replace(op, layout=other) if isinstance(op, CopyIn) else op for op in plan.ops)
    problems = check_plan(dataclasses.replace(plan, ops=ops))
    assert [p.rule for p in problems] == [Rule.NUMEL_MISMATCH, Rule.NUMEL_MISMATCH]
    assert "another unit's layout" in problems[0].message and "takes 19 elements into 22" in problems[1].message


def test_the_verifier_refuses_a_reduce_scatter_of_the_gradients_without_the_copy_in() -> None:
    plan = plan_post_backward(UNIT, FULL, division=GLOO_FSDP2)
    grad = buf("grad", 20)
    ops = []
    for op in plan.ops:
        if isinstance(op, CopyIn) or (isinstance(op, (RecordStream, Free)) and op.buffer.name == "grad.in"):
            continue
        if isinstance(op, RecordStream) and op.buffer == grad:
            continue
        kept = Free(buffer=grad, stream=PB) if isinstance(op, Free) and op.buffer == grad else op
        ops.append(dataclasses.replace(kept, src=grad) if isinstance(kept, ReduceScatter) else kept)
    rules = {p.rule for p in check_plan(dataclasses.replace(plan, ops=tuple(ops)))}
    assert Rule.NUMEL_MISMATCH in rules  # 20 elements are not 2 x 12


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            {"sharding": ShardingSpec(strategy=ShardingStrategy.NO_SHARD, shard_size=2)},
            "sharding.strategy: a per-parameter unit is sharded",
        ),
        ({"sharding": ShardingSpec(strategy=ShardingStrategy.FULL_SHARD, shard_size=4)}, "layout.world: the layout"),
        ({"comm_hook": CommHook.ALLREDUCE}, "comm_hook: fully_shard has no FSDP1 comm hooks"),
        ({"use_orig_params": True}, "use_orig_params: a per-parameter unit's parameters"),
        (
            {"mixed_precision": MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True)},
            "mixed_precision.keep_low_precision_grads:",
        ),
    ],
)
def test_a_per_parameter_request_refuses_what_fully_shard_has_not(change: dict[str, object], says: str) -> None:
    args: dict[str, object] = {"layout": UNIT, "sharding": FULL, **change}
    with pytest.raises(ValueError, match=f"^{re.escape(says)}"):
        PlanRequest(**args)  # type: ignore[arg-type]  # the fields under test, by name


def test_only_a_per_parameter_unit_takes_reshard_after_backward() -> None:
    flat = FlatParamLayout.of([("w", (4,))], F32)
    with pytest.raises(ValueError, match=r"^reshard_after_backward: a flat parameter reshards as its sharding"):
        PlanRequest(layout=flat, sharding=FULL, reshard_after_backward=True)
    with pytest.raises(TypeError, match=r"^reshard_after_backward: expected bool or NoneType, got int"):
        PlanRequest(layout=UNIT, sharding=FULL, reshard_after_backward=1)  # type: ignore[arg-type]  # a bad value on purpose
    kept = PlanRequest(layout=UNIT, sharding=FULL, reshard_after_backward=False)
    assert (kept.should_free_in_backward, kept.reshards_after_backward) == (False, False)
    assert PlanRequest(layout=UNIT, sharding=FULL).should_free_in_backward


def test_an_all_reduce_hook_is_called_on_the_reduced_and_divided_gradient_on_the_all_reduce_stream() -> None:
    """FSDP2's ``set_all_reduce_hook``: after the reduce-scatter and the division, on the all-reduce
    stream, where the rest then runs; the optimizer's gradient is what the hook left."""
    plan = plan_post_backward(UNIT, FULL, division=GLOO_FSDP2, all_reduce_hook=True)
    shard = buf("shard", 12)
    assert plan.ops[8:] == (
        Divide(buffer=shard, factor=2.0, stream=PB),
        WaitStream(stream=AR, waits_for=PB),
        RecordStream(buffer=shard, stream=AR),
        AllReduceHookCall(buffer=shard, stream=AR),
        EndOfBackwardWait(stream=C, waits_for=PB),
        EndOfBackwardWait(stream=C, waits_for=AR),
        GradViews(buffer=shard, views=RANK1, stream=C),
        HandOff(buffer=shard, destination=Destination.SHARDED_GRAD, stream=C),
    )
    assert check_plan(plan) == []
    assert "all_reduce_hook" in format_plan(plan)


def test_hsdp_calls_the_hook_after_the_all_reduce_and_not_on_a_kept_partial_reduction() -> None:
    plan = plan_post_backward(UNIT, HYBRID, division=GLOO_FSDP2, all_reduce_hook=True)
    kinds = [type(op).__name__ for op in plan.ops]
    assert kinds.index("AllReduceHookCall") == kinds.index("Divide") + 1 > kinds.index("AllReduce")
    assert check_plan(plan) == []
    kept = plan_post_backward(
        UNIT, HYBRID, division=GLOO_FSDP2, all_reduce_hook=True, flags=StepFlags(requires_all_reduce=False)
    )
    assert not any(isinstance(op, AllReduceHookCall) for op in kept.ops) and check_plan(kept) == []
    no_sync = plan_post_backward(UNIT, FULL, all_reduce_hook=True, flags=StepFlags(sync_gradients=False))
    assert not any(isinstance(op, AllReduceHookCall) for op in no_sync.ops) and check_plan(no_sync) == []


def test_the_verifier_refuses_a_hook_too_early_missing_or_not_asked_for() -> None:
    plan = plan_post_backward(UNIT, FULL, division=GLOO_FSDP2, all_reduce_hook=True)
    ops = list(plan.ops)
    (at,) = [i for i, op in enumerate(ops) if isinstance(op, AllReduceHookCall)]
    divide = next(i for i, op in enumerate(ops) if isinstance(op, Divide))
    early = [*ops[:divide], dataclasses.replace(ops[at], stream=PB), *ops[divide:at], *ops[at + 1 :]]
    problems = check_plan(dataclasses.replace(plan, ops=tuple(early)))
    assert [p.message for p in problems] == ["the all-reduce hook is shown a gradient not yet reduced and divided"]
    missing = check_plan(dataclasses.replace(plan, ops=tuple(ops[:at] + ops[at + 1 :])))
    assert [p.message for p in missing] == ["the all-reduce hook is called 0 time(s), expected 1"]
    unasked = dataclasses.replace(plan, request=dataclasses.replace(plan.request, all_reduce_hook=False))
    assert [p.message for p in check_plan(unasked)] == ["the all-reduce hook is called 1 time(s), expected 0"]
    with pytest.raises(ValueError, match=r"^all_reduce_hook: only a per-parameter \(fully_shard\) unit takes"):
        PlanRequest(layout=FlatParamLayout.of([("w", (4,))], F32), sharding=FULL, all_reduce_hook=True)
