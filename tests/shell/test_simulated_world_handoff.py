"""Every strategy, run over a simulated world, hands each rank exactly its shard of the average: in
the dtype mixed precision asks for, on the host under CPU offload, added into an existing sharded
gradient, and through ``use_orig_params`` views that rebuild each parameter.

Expected values come from ``simulated_world_cases``: plain torch, in float64, from the gradients
handed to the ranks, with offsets, shard sizes and FSDP1's pre-divide factors written out by hand;
nothing expected is computed by the planner, the layout or the division code under test. The first
tests check those hand-written layouts and the simulated mesh themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fsdp_core import CPUOffload, Destination, Device, Group, MixedPrecision, StepFlags
from fsdp_shell.runtime.simulate import WorldGeometry
from tests.shell.simulated_world_cases import (
    ALIGNED,
    ALIGNED_BF16,
    ALL_MESHES,
    BF16,
    BIG,
    F16,
    F32,
    LAYOUTS,
    ONE,
    ONE_OF_EACH,
    SEVEN,
    SS,
    LayoutCase,
    Mesh,
    assert_averaged,
    assert_views_rebuild_the_params,
    make_grads,
    mean_over_world,
    request_for,
    run,
    shard_numel,
)

# -- the hand-written facts the tests rely on ------------------------------------------------


@pytest.mark.parametrize("case", [ONE, SEVEN, BIG, ALIGNED, ALIGNED_BF16], ids=str)
def test_layout_cases_match_the_hand_worked_offsets(case: LayoutCase) -> None:
    layout = case.layout()
    assert layout.offsets == case.offsets
    assert layout.total_numel == case.total


def test_geometry_follows_the_replicate_by_shard_mesh() -> None:
    g = WorldGeometry(shard_size=3, replicate_size=2)
    assert g.world_size == 6
    assert [g.shard_rank(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [g.replicate_index(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert g.members(4, Group.SHARD) == (3, 4, 5)
    assert g.members(4, Group.REPLICATE) == (1, 4)


# -- strategies --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", LAYOUTS, ids=str)
@pytest.mark.parametrize("mesh", ALL_MESHES, ids=str)
def test_every_strategy_hands_each_rank_its_shard_of_the_average(mesh: Mesh, case: LayoutCase) -> None:
    grads = make_grads(mesh.world, case.total, F32, seed=1)
    result = run(request_for(mesh, case), grads)
    assert_averaged(result, mesh, mean_over_world(grads))
    for r in result.ranks:
        assert r.unsharded_param_freed is mesh.sharded
        assert r.hook_calls == () and r.views == ()


# -- mixed precision ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MPCase:
    mp: MixedPrecision
    compute: torch.dtype
    handed: torch.dtype
    precision: torch.dtype

    def __str__(self) -> str:
        m = self.mp
        return f"param={m.param_dtype}-reduce={m.reduce_dtype}-keep={m.keep_low_precision_grads}"


MP_CASES = [
    MPCase(MixedPrecision(param_dtype=BF16, reduce_dtype=F32), BF16, F32, F32),
    MPCase(MixedPrecision(param_dtype=F16, reduce_dtype=F16), F16, F32, F16),
    MPCase(MixedPrecision(param_dtype=F16), F16, F32, F16),
    MPCase(MixedPrecision(reduce_dtype=BF16), F32, F32, BF16),
    MPCase(MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True), BF16, BF16, BF16),
    MPCase(MixedPrecision(param_dtype=F16, reduce_dtype=F32, keep_low_precision_grads=True), F16, F32, F32),
    MPCase(MixedPrecision(param_dtype=F16, reduce_dtype=BF16, keep_low_precision_grads=True), F16, BF16, BF16),
]


@pytest.mark.parametrize("case", MP_CASES, ids=str)
@pytest.mark.parametrize("mesh", ONE_OF_EACH, ids=str)
def test_mixed_precision_reduces_in_the_reduce_dtype_and_hands_off_the_param_dtype(mesh: Mesh, case: MPCase) -> None:
    grads = make_grads(mesh.world, ALIGNED.total, case.compute, seed=2)
    result = run(request_for(mesh, ALIGNED, mixed_precision=case.mp), grads)
    assert_averaged(result, mesh, mean_over_world(grads), precision=case.precision, dtype=case.handed)


@pytest.mark.parametrize("mesh", ONE_OF_EACH, ids=str)
def test_force_full_precision_computes_and_reduces_in_the_param_dtype(mesh: Mesh) -> None:
    mp = MixedPrecision(param_dtype=BF16, reduce_dtype=BF16, keep_low_precision_grads=True)
    grads = make_grads(mesh.world, BIG.total, F32, seed=3)
    result = run(request_for(mesh, BIG, mixed_precision=mp, flags=StepFlags(force_full_precision=True)), grads)
    assert_averaged(result, mesh, mean_over_world(grads), precision=F32, dtype=F32)


# -- CPU offload and accumulation ------------------------------------------------------------


@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh", "accumulate"])
@pytest.mark.parametrize("mesh", ONE_OF_EACH, ids=str)
def test_cpu_offload_hands_off_on_the_host(mesh: Mesh, accumulate: bool) -> None:
    grads = make_grads(mesh.world, BIG.total, F32, seed=4)
    existing = make_grads(mesh.world, shard_numel(mesh, BIG.total), F32, seed=5) if accumulate else None
    request = request_for(mesh, BIG, offload=CPUOffload(offload_params=True), flags=StepFlags(accumulate=accumulate))
    result = run(request, grads, sharded_grads=existing)
    assert_averaged(
        result, mesh, mean_over_world(grads), destination=Destination.CPU_GRAD, device=Device.HOST, existing=existing
    )


@pytest.mark.parametrize("mesh", ONE_OF_EACH, ids=str)
def test_cpu_offload_with_mixed_precision_hands_off_the_param_dtype(mesh: Mesh) -> None:
    grads = make_grads(mesh.world, SEVEN.total, BF16, seed=6)
    mp = MixedPrecision(param_dtype=BF16, reduce_dtype=F32)
    result = run(request_for(mesh, offload=CPUOffload(offload_params=True), mixed_precision=mp), grads)
    assert_averaged(result, mesh, mean_over_world(grads), destination=Destination.CPU_GRAD, device=Device.HOST)


@pytest.mark.parametrize("keep", [False, True], ids=["fp32-grads", "bf16-grads"])
@pytest.mark.parametrize("mesh", ONE_OF_EACH, ids=str)
def test_accumulate_adds_into_the_existing_sharded_grad(mesh: Mesh, keep: bool) -> None:
    mp = MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True) if keep else MixedPrecision()
    compute, precision = (BF16, BF16) if keep else (F32, F32)
    grads = make_grads(mesh.world, ALIGNED.total, compute, seed=7)
    existing = make_grads(mesh.world, shard_numel(mesh, ALIGNED.total), compute, seed=8)
    request = request_for(mesh, ALIGNED, mixed_precision=mp, flags=StepFlags(accumulate=True))
    result = run(request, grads, sharded_grads=existing)
    assert_averaged(
        result,
        mesh,
        mean_over_world(grads),
        precision=precision,
        dtype=compute,
        destination=Destination.ACCUMULATED_GRAD,
        existing=existing,
    )


# -- use_orig_params ---------------------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("case", [ALIGNED, ALIGNED_BF16], ids=str)
@pytest.mark.parametrize("mesh", [*ONE_OF_EACH, Mesh(SS.FULL_SHARD, 8), Mesh(SS.HYBRID_SHARD, 4, 2)], ids=str)
def test_use_orig_params_views_rebuild_each_parameter(mesh: Mesh, case: LayoutCase, offload: bool) -> None:
    mp = MixedPrecision(param_dtype=BF16, reduce_dtype=F32) if case.align_dtype is BF16 else MixedPrecision()
    compute = BF16 if case.align_dtype is BF16 else F32
    grads = make_grads(mesh.world, case.total, compute, seed=9)
    request = request_for(
        mesh, case, use_orig_params=True, mixed_precision=mp, offload=CPUOffload(offload_params=offload)
    )
    result = run(request, grads)
    full = mean_over_world(grads)
    assert_averaged(
        result,
        mesh,
        full,
        destination=Destination.CPU_GRAD if offload else Destination.SHARDED_GRAD,
        device=Device.HOST if offload else Device.DEVICE,
    )
    assert_views_rebuild_the_params(result, mesh, case, full, F32)
