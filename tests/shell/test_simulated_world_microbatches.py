"""Gradients carried between backwards, over a simulated world: inside ``no_sync`` each rank keeps
its unsharded gradient and the sync step reduces the sum; a hybrid strategy with the replicate
all-reduce deferred keeps a partial per shard group, then averages every microbatch.

Expected values come from ``simulated_world_cases``: plain torch, in float64, from the gradients
handed to the ranks, with offsets, shard sizes and FSDP1's pre-divide factors written out by
hand; nothing expected is computed by the planner, the layout or the division code under test.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from fsdp_core import CommHook, Destination, Division, DivisionPolicy, Group, MixedPrecision, StepFlags
from tests.shell.simulated_world_cases import (
    ALIGNED,
    BF16,
    BIG,
    F16,
    F32,
    FREED_INSIDE_NO_SYNC,
    FSDP1_PREDIVIDE,
    GLOO,
    HYBRID_MESHES,
    NCCL,
    ONE_OF_EACH,
    SEVEN,
    SS,
    Mesh,
    assert_averaged,
    assert_values,
    assert_views_rebuild_the_params,
    make_grads,
    mean_over_world,
    request_for,
    run,
    shard_numel,
    shard_of,
    summed,
)

# -- no_sync -----------------------------------------------------------------------------------


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig-params"])
@pytest.mark.parametrize(
    "mp", [MixedPrecision(), MixedPrecision(param_dtype=BF16, reduce_dtype=F32)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("mesh", ONE_OF_EACH, ids=str)
def test_no_sync_accumulates_locally_then_the_sync_step_reduces_the_sum(
    mesh: Mesh, mp: MixedPrecision, use_orig_params: bool
) -> None:
    compute = mp.param_dtype or F32
    case = ALIGNED
    a, b, c = (make_grads(mesh.world, case.total, compute, seed=s) for s in (11, 12, 13))
    no_sync = request_for(
        mesh, case, mixed_precision=mp, use_orig_params=use_orig_params, flags=StepFlags(sync_gradients=False)
    )

    first = run(no_sync, a)
    for g, r in enumerate(first.ranks):
        assert r.destination is Destination.UNSHARDED_GRAD and r.grad is not None
        assert r.grad.dtype == compute
        assert torch.equal(r.grad, a[g])
        assert r.issued == ()
        low_precision_copy = mesh.strategy is SS.NO_SHARD and compute != F32
        assert r.unsharded_param_freed is (FREED_INSIDE_NO_SYNC[mesh.strategy] or low_precision_copy)
        if use_orig_params:
            for v in r.views:
                start, _ = case.param_slices()[v.param_name]
                assert v.offset_in_param == 0
                assert torch.equal(v.tensor, a[g][start : start + v.tensor.numel()])
        else:
            assert r.views == ()

    second = run(
        replace(no_sync, flags=StepFlags(sync_gradients=False, pending_unsharded=True)),
        b,
        pending_unsharded=first.grads,
    )
    for g, r in enumerate(second.ranks):
        assert r.destination is Destination.UNSHARDED_GRAD
        assert_values(r.grad if r.grad is not None else torch.empty(0), summed(a, b)[g], compute)
        assert r.issued == ()

    sync = replace(no_sync, flags=StepFlags(pending_unsharded=True))
    third = run(sync, c, pending_unsharded=second.grads)
    full = mean_over_world(summed(a, b, c))
    assert_averaged(third, mesh, full, precision=compute)
    if use_orig_params:
        assert_views_rebuild_the_params(third, mesh, case, full, compute)


# -- hybrid with the all-reduce deferred ---------------------------------------------------------


@dataclass(frozen=True)
class DeferCase:
    """A hybrid variant; ``partial_divisor(mesh)`` is what the kept partial is divided by (None:
    not checked), ``final_divisor`` the user's factor (None: the world size)."""

    name: str
    hook: CommHook = CommHook.NONE
    division: Division = Division()
    final_divisor: float | None = None
    check_partial: bool = True
    precision: torch.dtype = F32

    def partial_divisor(self, mesh: Mesh) -> float:
        if self.hook is not CommHook.NONE:
            return float(mesh.shard)
        return float(FSDP1_PREDIVIDE[mesh.world])

    def __str__(self) -> str:
        return self.name


DEFER_CASES = [
    DeferCase("fsdp1-division"),
    DeferCase("nccl-avg", division=Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL), check_partial=False),
    DeferCase(
        "nccl-factor",
        division=Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=5.0),
        final_divisor=5.0,
        check_partial=False,
    ),
    DeferCase(
        "gloo-factor",
        division=Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO, factor=2.5),
        final_divisor=2.5,
        check_partial=False,
    ),
    DeferCase("hook-reduce-scatter", hook=CommHook.REDUCE_SCATTER),
    DeferCase("hook-allreduce", hook=CommHook.ALLREDUCE),
    DeferCase("hook-user", hook=CommHook.USER),
    DeferCase(
        "hook-user-nccl", hook=CommHook.USER, division=Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL)
    ),
    DeferCase(
        "hook-allreduce-gloo",
        hook=CommHook.ALLREDUCE,
        division=Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO),
    ),
    DeferCase("hook-fp16-compress", hook=CommHook.FP16_COMPRESS, precision=F16),
]


@pytest.mark.parametrize("case", DEFER_CASES, ids=str)
@pytest.mark.parametrize("mesh", HYBRID_MESHES, ids=str)
def test_deferred_all_reduce_keeps_a_partial_then_reduces_every_microbatch(mesh: Mesh, case: DeferCase) -> None:
    a, b, c = (make_grads(mesh.world, BIG.total, F32, seed=s) for s in (14, 15, 16))
    base = request_for(mesh, BIG, comm_hook=case.hook, division=case.division)

    first = run(replace(base, flags=StepFlags(requires_all_reduce=False)), a)
    second = run(
        replace(base, flags=StepFlags(requires_all_reduce=False, pending_partial=True)), b, partials=first.grads
    )
    for step, result, grads in ((1, first, summed(a)), (2, second, summed(a, b))):
        for g, r in enumerate(result.ranks):
            assert r.destination is Destination.PARTIAL and r.grad is not None, f"step {step}"
            assert not any(i.kind == "all_reduce" and i.group is Group.REPLICATE for i in r.issued)
            if case.check_partial:
                replica = range(g - g % mesh.shard, g - g % mesh.shard + mesh.shard)
                shard_sum = mean_over_world([grads[m] for m in replica], case.partial_divisor(mesh))
                assert_values(r.grad, shard_of(shard_sum, mesh, g), case.precision)

    third = run(replace(base, flags=StepFlags(pending_partial=True)), c, partials=second.grads)
    assert_averaged(third, mesh, mean_over_world(summed(a, b, c), case.final_divisor), precision=case.precision)


@pytest.mark.parametrize("mesh", HYBRID_MESHES, ids=str)
def test_deferred_all_reduce_then_accumulate_into_an_existing_grad(mesh: Mesh) -> None:
    a, b = (make_grads(mesh.world, SEVEN.total, F32, seed=s) for s in (17, 18))
    existing = make_grads(mesh.world, shard_numel(mesh, SEVEN.total), F32, seed=19)
    first = run(request_for(mesh, flags=StepFlags(requires_all_reduce=False, accumulate=True)), a)
    final = run(
        request_for(mesh, flags=StepFlags(pending_partial=True, accumulate=True)),
        b,
        partials=first.grads,
        sharded_grads=existing,
    )
    assert_averaged(
        final, mesh, mean_over_world(summed(a, b)), destination=Destination.ACCUMULATED_GRAD, existing=existing
    )
