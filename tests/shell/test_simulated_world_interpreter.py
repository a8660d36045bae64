"""The simulated world's interpreter itself: a plan altered to free a buffer early, to drop its
division or to issue different collectives on different ranks fails or averages wrongly; the
inputs must match what the plan declares and are never modified; the sync and async replicate
all-reduce give bit-identical gradients.

Expected values come from ``simulated_world_cases``: plain torch, in float64, from the gradients
handed to the ranks, with offsets, shard sizes and FSDP1's pre-divide factors written out by
hand; nothing expected is computed by the planner, the layout or the division code under test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from fsdp_core import (
    Divide,
    Free,
    Group,
    HybridAllReduce,
    Input,
    Op,
    Plan,
    PlanRequest,
    ReduceKind,
    ReduceOpSpec,
    ReduceScatter,
    StepFlags,
    Stream,
    build_plan,
)
from fsdp_shell.runtime.simulate import SimulationError, simulate
from tests.shell.simulated_world_cases import (
    BF16,
    BIG,
    F32,
    HYBRID_MESHES,
    SEVEN,
    SS,
    Mesh,
    assert_averaged,
    make_grads,
    mean_over_world,
    request_for,
    run,
    shard_numel,
)

# -- the interpreter itself ------------------------------------------------------------------


def altered(change: Callable[[Plan], tuple[Op, ...]]) -> Callable[[PlanRequest], Plan]:
    """A planner that rewrites the ops of the real plan."""

    def planner(request: PlanRequest) -> Plan:
        plan = build_plan(request)
        return replace(plan, ops=change(plan))

    return planner


def test_a_use_after_free_fails() -> None:
    def free_grad_early(plan: Plan) -> tuple[Op, ...]:
        ops = list(plan.ops)
        at = next(i for i, op in enumerate(ops) if isinstance(op, Input))
        grad = ops[at]
        assert isinstance(grad, Input)
        ops.insert(at + 1, Free(buffer=grad.buffer, stream=Stream.COMPUTE))
        return tuple(ops)

    mesh = Mesh(SS.FULL_SHARD, 2)
    with pytest.raises(SimulationError, match="is not live"):
        simulate(request_for(mesh), make_grads(2, SEVEN.total, F32, 0), planner=altered(free_grad_early))


def test_a_dropped_division_gives_a_wrong_average() -> None:
    mesh = Mesh(SS.FULL_SHARD, 4)
    grads = make_grads(4, BIG.total, F32, 0)
    result = simulate(
        request_for(mesh, BIG),
        grads,
        planner=altered(lambda p: tuple(op for op in p.ops if not isinstance(op, Divide))),
    )
    with pytest.raises(AssertionError):
        assert_averaged(result, mesh, mean_over_world(grads))


def test_ranks_issuing_different_collectives_fail() -> None:
    avg = ReduceOpSpec(kind=ReduceKind.AVG)

    def rank_one_averages(plan: Plan) -> tuple[Op, ...]:
        if plan.request.sharding.rank != 1:
            return plan.ops
        return tuple(replace(op, reduce_op=avg) if isinstance(op, ReduceScatter) else op for op in plan.ops)

    with pytest.raises(SimulationError, match="different collectives"):
        simulate(
            request_for(Mesh(SS.FULL_SHARD, 2)), make_grads(2, SEVEN.total, F32, 0), planner=altered(rank_one_averages)
        )


@pytest.mark.parametrize(
    ("flags", "inputs", "message"),
    [
        (StepFlags(accumulate=True), {}, "sharded_grad input .* not supplied"),
        (StepFlags(), {"sharded_grads": True}, "never taken by the plan: sharded_grad"),
        (StepFlags(pending_unsharded=True), {}, "pending_unsharded input .* not supplied"),
    ],
)
def test_inputs_must_match_the_plan(flags: StepFlags, inputs: dict[str, bool], message: str) -> None:
    mesh = Mesh(SS.FULL_SHARD, 2)
    existing = make_grads(2, shard_numel(mesh, SEVEN.total), F32, 0) if inputs.get("sharded_grads") else None
    with pytest.raises(SimulationError, match=message):
        simulate(request_for(mesh, flags=flags), make_grads(2, SEVEN.total, F32, 0), sharded_grads=existing)


def test_grads_must_match_the_declared_buffer_and_world() -> None:
    mesh = Mesh(SS.FULL_SHARD, 2)
    with pytest.raises(SimulationError, match="the plan declares"):
        simulate(request_for(mesh), make_grads(2, SEVEN.total, BF16, 0))
    with pytest.raises(SimulationError, match="one tensor per rank"):
        simulate(request_for(mesh), make_grads(3, SEVEN.total, F32, 0))


def test_inputs_are_not_modified() -> None:
    mesh = Mesh(SS.HYBRID_SHARD, 2, 2)
    grads = make_grads(4, SEVEN.total, F32, 0)
    pending = make_grads(4, SEVEN.total, F32, 1)
    before = [t.clone() for t in grads + pending]
    run(request_for(mesh, flags=StepFlags(pending_unsharded=True)), grads, pending_unsharded=pending)
    assert all(torch.equal(x, y) for x, y in zip(grads + pending, before))


@pytest.mark.parametrize("mesh", HYBRID_MESHES, ids=str)
@pytest.mark.parametrize("flags", [StepFlags(), StepFlags(accumulate=True), StepFlags(pending_partial=True)], ids=str)
def test_sync_and_async_replicate_all_reduce_give_the_same_numbers(mesh: Mesh, flags: StepFlags) -> None:
    """``hybrid_all_reduce`` moves the all-reduce to another stream and nothing else: every rank
    receives bit-identical gradients either way, and the sync plan keeps it on post_backward."""
    grads = make_grads(mesh.world, BIG.total, F32, seed=31)
    shard = shard_numel(mesh, BIG.total)
    existing = make_grads(mesh.world, shard, F32, seed=32) if flags.accumulate else None
    partials = make_grads(mesh.world, shard, F32, seed=33) if flags.pending_partial else None
    results = {}
    for placement in HybridAllReduce:
        request = replace(request_for(mesh, BIG, flags=flags), hybrid_all_reduce=placement)
        results[placement] = run(request, grads, sharded_grads=existing, partials=partials)
        streams = {
            i.stream
            for i in results[placement].ranks[0].issued
            if i.kind == "all_reduce" and i.group is Group.REPLICATE
        }
        assert streams == {Stream.POST_BACKWARD if placement is HybridAllReduce.SYNC else Stream.ALL_REDUCE}
    for a, b in zip(results[HybridAllReduce.ASYNC].ranks, results[HybridAllReduce.SYNC].ranks):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
