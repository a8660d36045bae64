"""Every plan, run over a simulated world, hands each rank exactly its shard of the average.

Expected values are computed here with plain torch, in float64, from the gradients handed to the
ranks: the sum over every data-parallel rank, divided by the world size (or the user's factor),
zero-padded to a multiple of the shard group size, sliced to the rank's shard. Offsets, shard
sizes and FSDP1's pre-divide factors are written out by hand; nothing expected is computed by
the planner, the layout or the division code under test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import Tensor

from fsdp_core import (
    BackendCaps,
    CommHook,
    CPUOffload,
    Destination,
    Device,
    Divide,
    Division,
    DivisionPolicy,
    FlatParamLayout,
    Free,
    Group,
    HybridAllReduce,
    Input,
    MixedPrecision,
    Op,
    Plan,
    PlanRequest,
    ReduceKind,
    ReduceOpSpec,
    ReduceScatter,
    ShardingSpec,
    ShardingStrategy,
    StepFlags,
    Stream,
    build_plan,
    check_plan,
)
from fsdp_shell.runtime.simulate import SimulationError, WorldGeometry, WorldResult, simulate
from tests.budget import budget

SS = ShardingStrategy
F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
NCCL = BackendCaps(supports_avg=True, supports_premul_sum=True)
GLOO = BackendCaps()

# -- worlds and layouts, written out by hand ------------------------------------------------


@dataclass(frozen=True)
class Mesh:
    """A world of ``replicate x shard`` ranks running ``strategy``."""

    strategy: ShardingStrategy
    shard: int
    replicate: int = 1

    @property
    def world(self) -> int:
        return self.shard * self.replicate

    @property
    def sharded(self) -> bool:
        return self.strategy is not SS.NO_SHARD

    def spec(self) -> ShardingSpec:
        return ShardingSpec(strategy=self.strategy, shard_size=self.shard, replicate_size=self.replicate)

    def __str__(self) -> str:
        return f"{self.strategy.name}-{self.replicate}x{self.shard}"


FLAT_STRATEGIES = (SS.NO_SHARD, SS.FULL_SHARD, SS.SHARD_GRAD_OP)
HYBRID = (SS.HYBRID_SHARD, SS.HYBRID_SHARD_ZERO2)
ALL_MESHES = [Mesh(s, w) for s in FLAT_STRATEGIES for w in (1, 2, 3, 4, 8)] + [
    Mesh(s, shard, rep) for s in HYBRID for shard, rep in ((2, 2), (2, 3), (4, 2), (4, 1), (1, 3))
]
ONE_OF_EACH = [
    Mesh(SS.NO_SHARD, 3),
    Mesh(SS.FULL_SHARD, 4),
    Mesh(SS.SHARD_GRAD_OP, 3),
    Mesh(SS.HYBRID_SHARD, 2, 3),
    Mesh(SS.HYBRID_SHARD_ZERO2, 4, 2),
]
HYBRID_MESHES = [Mesh(s, shard, rep) for s in HYBRID for shard, rep in ((2, 2), (2, 3), (4, 2), (1, 3))]

FSDP1_PREDIVIDE = {1: 1, 2: 2, 3: 2, 4: 2, 6: 4, 8: 4}
"""FSDP1's ``_get_gradient_predivide_factor`` by world size, worked out by hand."""

FREED_INSIDE_NO_SYNC = {
    SS.NO_SHARD: False,
    SS.FULL_SHARD: True,
    SS.SHARD_GRAD_OP: False,
    SS.HYBRID_SHARD: True,
    SS.HYBRID_SHARD_ZERO2: False,
}
"""FSDP1's ``_should_free_in_backward`` inside ``no_sync``: ZeRO-2 strategies keep the parameter.
``NO_SHARD`` frees a low-precision copy at every reshard all the same (FSDP1's ``post_reshard``)."""


@dataclass(frozen=True)
class LayoutCase:
    """A flat parameter with its offsets and total numel worked out by hand."""

    name: str
    params: tuple[tuple[str, tuple[int, ...]], ...]
    offsets: tuple[int, ...]
    total: int
    align: bool = False
    align_dtype: torch.dtype | None = None

    def layout(self) -> FlatParamLayout:
        return FlatParamLayout.of(self.params, F32, align=self.align, align_dtype=self.align_dtype)

    def param_slices(self) -> dict[str, tuple[int, int]]:
        out = {}
        for (name, shape), offset in zip(self.params, self.offsets):
            out[name] = (offset, offset + int(torch.Size(shape).numel()))
        return out

    def __str__(self) -> str:
        return self.name


THREE = (("a", (3,)), ("b", (2, 5)), ("c", (7,)))
ONE = LayoutCase("one", (("w", (1,)),), (0,), 1)
SEVEN = LayoutCase("seven", (("w", (7,)),), (0,), 7)
BIG = LayoutCase("1001", (("w", (1001,)),), (0,), 1001)
ALIGNED = LayoutCase("aligned-fp32", THREE, (0, 4, 16), 23, align=True)
"""16-byte alignment in float32 is 4 elements: a [0, 3), pad 1, b [4, 14), pad 2, c [16, 23)."""
ALIGNED_BF16 = LayoutCase("aligned-bf16", THREE, (0, 8, 24), 31, align=True, align_dtype=BF16)
"""16-byte alignment in bfloat16 is 8 elements: a [0, 3), pad 5, b [8, 18), pad 6, c [24, 31)."""
LAYOUTS = [ONE, SEVEN, BIG, ALIGNED]


# -- expected values -------------------------------------------------------------------------


def make_grads(n: int, numel: int, dtype: torch.dtype, seed: int) -> list[Tensor]:
    """``n`` random gradients, rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen, dtype=F64).to(dtype) for _ in range(n)]


def summed(*steps: Sequence[Tensor]) -> list[Tensor]:
    """Per rank, the float64 sum of that rank's tensors over several steps."""
    return [torch.stack([s[g].double() for s in steps]).sum(0) for g in range(len(steps[0]))]


def mean_over_world(grads: Sequence[Tensor], divisor: float | None = None) -> Tensor:
    """The float64 sum over ranks divided by the world size or ``divisor``."""
    total = torch.stack([g.double() for g in grads]).sum(0)
    return total / (len(grads) if divisor is None else divisor)


def shard_of(full: Tensor, mesh: Mesh, rank: int) -> Tensor:
    """Global ``rank``'s shard of an unsharded flat tensor: zero-pad to a multiple of the shard
    group size, take chunk ``rank % shard``. ``NO_SHARD`` keeps everything."""
    if not mesh.sharded:
        return full
    n = full.numel()
    chunk = -(-n // mesh.shard)
    padded = torch.cat([full, full.new_zeros(chunk * mesh.shard - n)])
    s = rank % mesh.shard
    return padded[s * chunk : (s + 1) * chunk]


def shard_numel(mesh: Mesh, total: int) -> int:
    return -(-total // mesh.shard) if mesh.sharded else total


TOLERANCE = {F64: (1e-9, 1e-9), F32: (1e-5, 1e-5), F16: (3e-3, 3e-3), BF16: (3e-2, 3e-2)}
"""``(rtol, atol)`` by the lowest precision on the gradient's path."""


def assert_values(got: Tensor, want: Tensor, precision: torch.dtype) -> None:
    rtol, atol = TOLERANCE[precision]
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


def run(
    request: PlanRequest,
    grads: Sequence[Tensor],
    *,
    pending_unsharded: Sequence[Tensor] | None = None,
    sharded_grads: Sequence[Tensor] | None = None,
    partials: Sequence[Tensor] | None = None,
) -> WorldResult:
    """Simulate ``request``, after proving every rank's plan sound."""
    result = simulate(
        request, grads, pending_unsharded=pending_unsharded, sharded_grads=sharded_grads, partials=partials
    )
    for r in result.ranks:
        assert check_plan(r.plan) == [], f"rank {r.rank}: {check_plan(r.plan)}"
    return result


def request_for(
    mesh: Mesh,
    case: LayoutCase = SEVEN,
    *,
    mixed_precision: MixedPrecision = MixedPrecision(),
    offload: CPUOffload = CPUOffload(),
    comm_hook: CommHook = CommHook.NONE,
    division: Division = Division(),
    use_orig_params: bool = False,
    flags: StepFlags = StepFlags(),
) -> PlanRequest:
    return PlanRequest(
        layout=case.layout(),
        sharding=mesh.spec(),
        mixed_precision=mixed_precision,
        offload=offload,
        comm_hook=comm_hook,
        division=division,
        use_orig_params=use_orig_params,
        flags=flags,
    )


def assert_averaged(
    result: WorldResult,
    mesh: Mesh,
    full: Tensor,
    *,
    precision: torch.dtype = F32,
    dtype: torch.dtype = F32,
    destination: Destination = Destination.SHARDED_GRAD,
    device: Device = Device.DEVICE,
    existing: Sequence[Tensor] | None = None,
) -> None:
    """Every rank handed off its shard of ``full`` (plus its ``existing`` gradient), in ``dtype``
    at ``destination`` on ``device``, and freed everything else."""
    for g, r in enumerate(result.ranks):
        assert r.grad is not None and r.buffer is not None
        assert r.destination is destination
        assert r.buffer.device is device
        assert r.grad.dtype == dtype and r.grad.device.type == "cpu"
        assert r.grad.numel() == shard_numel(mesh, full.numel())
        want = shard_of(full, mesh, g)
        if existing is not None:
            want = want + existing[g].double()
        assert_values(r.grad, want, precision)
        assert r.live_buffers == ()


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


def assert_views_rebuild_the_params(
    result: WorldResult, mesh: Mesh, case: LayoutCase, full: Tensor, precision: torch.dtype
) -> None:
    """Each rank's views are views of its handed-off tensor; within every shard group (every
    rank, for ``NO_SHARD``) they tile each original parameter, whose concatenation in rank order
    is that parameter's slice of the averaged flat gradient."""
    covers = (
        [[g] for g in range(mesh.world)]
        if not mesh.sharded
        else [list(range(r * mesh.shard, (r + 1) * mesh.shard)) for r in range(mesh.replicate)]
    )
    for ranks in covers:
        for name, (start, end) in case.param_slices().items():
            pieces = [v for g in ranks for v in result.ranks[g].views if v.param_name == name]
            assert [v.offset_in_param for v in pieces] == sorted(v.offset_in_param for v in pieces)
            offsets = [0]
            for v in pieces:
                offsets.append(offsets[-1] + v.tensor.numel())
            assert [v.offset_in_param for v in pieces] == offsets[:-1]
            assert offsets[-1] == end - start
            if pieces:
                assert_values(torch.cat([v.tensor for v in pieces]), full[start:end], precision)
    for r in result.ranks:
        assert r.grad is not None
        for v in r.views:
            assert v.tensor.untyped_storage().data_ptr() == r.grad.untyped_storage().data_ptr()


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


# -- communication hooks -----------------------------------------------------------------------


HOOK_PRECISION = {
    CommHook.ALLREDUCE: F32,
    CommHook.REDUCE_SCATTER: F32,
    CommHook.USER: F32,
    CommHook.FP16_COMPRESS: F16,
    CommHook.BF16_COMPRESS: BF16,
}
HOOK_MESHES = [
    Mesh(SS.NO_SHARD, 1),
    Mesh(SS.NO_SHARD, 3),
    Mesh(SS.NO_SHARD, 4),
    Mesh(SS.FULL_SHARD, 3),
    Mesh(SS.FULL_SHARD, 8),
    Mesh(SS.SHARD_GRAD_OP, 4),
    Mesh(SS.HYBRID_SHARD, 2, 3),
    Mesh(SS.HYBRID_SHARD, 1, 3),
    Mesh(SS.HYBRID_SHARD_ZERO2, 4, 2),
]


@pytest.mark.parametrize(
    ("mesh", "hook"),
    [
        pytest.param(mesh, hook, id=f"{mesh}-{hook.value}")
        for mesh in HOOK_MESHES
        for hook in HOOK_PRECISION
        if mesh.sharded or hook is not CommHook.REDUCE_SCATTER
    ],
)
def test_comm_hooks_average_and_the_replicate_all_reduce_still_follows(mesh: Mesh, hook: CommHook) -> None:
    grads = make_grads(mesh.world, BIG.total, F32, seed=20)
    result = run(request_for(mesh, BIG, comm_hook=hook), grads)
    assert_averaged(result, mesh, mean_over_world(grads), precision=HOOK_PRECISION[hook])
    wire = {CommHook.FP16_COMPRESS: F16, CommHook.BF16_COMPRESS: BF16}.get(hook, F32)
    for g, r in enumerate(result.ranks):
        first = g - g % mesh.shard
        (call,) = r.hook_calls
        assert call.hook is hook and call.members == tuple(range(first, first + mesh.shard))
        assert call.pre * call.post == mesh.shard
        assert [(i.kind, i.group, i.dtype) for i in r.issued] == [("comm_hook", Group.SHARD, wire)] + (
            [("all_reduce", Group.REPLICATE, F32)] if mesh.strategy in HYBRID else []
        )


@pytest.mark.parametrize("hook", [CommHook.FP16_COMPRESS, CommHook.BF16_COMPRESS, CommHook.USER], ids=lambda h: h.value)
@pytest.mark.parametrize("mesh", [Mesh(SS.NO_SHARD, 4), Mesh(SS.FULL_SHARD, 3), Mesh(SS.HYBRID_SHARD, 2, 2)], ids=str)
def test_comm_hooks_under_bf16_compute(mesh: Mesh, hook: CommHook) -> None:
    grads = make_grads(mesh.world, SEVEN.total, BF16, seed=21)
    result = run(request_for(mesh, comm_hook=hook, mixed_precision=MixedPrecision(param_dtype=BF16)), grads)
    assert_averaged(result, mesh, mean_over_world(grads), precision=BF16)


# -- division policies -------------------------------------------------------------------------


@dataclass(frozen=True)
class DivisionCase:
    name: str
    division: Division
    mp: MixedPrecision = MixedPrecision()
    precision: torch.dtype = F32

    def __str__(self) -> str:
        return self.name


DIVISION_CASES = [
    DivisionCase("nccl", Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL)),
    DivisionCase("gloo", Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO)),
    DivisionCase("nccl-factor-5", Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=5.0)),
    DivisionCase("gloo-factor-5", Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO, factor=5.0)),
    DivisionCase("pre-post-factor-6", Division(factor=6.0)),
    DivisionCase("pre-post-factor-2.5", Division(factor=2.5)),
    DivisionCase("pre-post-factor-0.5", Division(factor=0.5)),
    DivisionCase(
        "nccl-fp16", Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL), MixedPrecision(param_dtype=F16), F16
    ),
    DivisionCase(
        "nccl-bf16", Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL), MixedPrecision(param_dtype=BF16), BF16
    ),
    DivisionCase(
        "nccl-bf16-factor-3",
        Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=3.0),
        MixedPrecision(reduce_dtype=BF16),
        BF16,
    ),
    DivisionCase(
        "gloo-fp16-factor-3",
        Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO, factor=3.0),
        MixedPrecision(reduce_dtype=F16),
        F16,
    ),
]


@pytest.mark.parametrize("case", DIVISION_CASES, ids=str)
@pytest.mark.parametrize("mesh", [*ONE_OF_EACH, Mesh(SS.FULL_SHARD, 1), Mesh(SS.HYBRID_SHARD, 4, 2)], ids=str)
def test_division_policies_divide_the_sum_by_the_world_or_the_factor(mesh: Mesh, case: DivisionCase) -> None:
    compute = case.mp.param_dtype or F32
    grads = make_grads(mesh.world, BIG.total, compute, seed=22)
    result = run(request_for(mesh, BIG, division=case.division, mixed_precision=case.mp), grads)
    assert_averaged(result, mesh, mean_over_world(grads, case.division.factor), precision=case.precision)


def test_in_collective_division_on_nccl_averages_inside_the_collectives() -> None:
    mesh = Mesh(SS.HYBRID_SHARD, 2, 2)
    grads = make_grads(mesh.world, SEVEN.total, F32, seed=23)
    result = run(request_for(mesh, division=Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL)), grads)
    r = result.ranks[0]
    assert not any(isinstance(op, Divide) for op in r.plan.ops)
    assert [(i.kind, i.reduce_op and i.reduce_op.kind) for i in r.issued] == [
        ("reduce_scatter", ReduceKind.AVG),
        ("all_reduce", ReduceKind.AVG),
    ]


# -- properties ------------------------------------------------------------------------------


ALIGNMENT_NUMEL = {F64: 2, F32: 4, F16: 8, BF16: 8}
"""16 bytes in elements of each compute dtype."""


def lowest_precision(dtypes: set[torch.dtype]) -> torch.dtype:
    return next(d for d in (BF16, F16, F32, F64) if d in dtypes)


@budget(200)
@given(
    strategy=st.sampled_from(list(SS)),
    shard=st.integers(1, 4),
    replicate=st.integers(1, 3),
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=3).filter(lambda s: sum(s) > 0),
    orig=st.sampled_from([F32, F64, BF16]),
    mp=st.sampled_from(
        [
            MixedPrecision(),
            MixedPrecision(param_dtype=BF16, reduce_dtype=F32),
            MixedPrecision(param_dtype=F16),
            MixedPrecision(param_dtype=F16, reduce_dtype=BF16),
            MixedPrecision(reduce_dtype=BF16, keep_low_precision_grads=True),
            MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True),
            MixedPrecision(param_dtype=BF16, reduce_dtype=F16, keep_low_precision_grads=True),
        ]
    ),
    hook=st.sampled_from(list(CommHook)),
    division=st.sampled_from(
        [
            Division(),
            Division(factor=3.0),
            Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL),
            Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=7.0),
            Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO),
        ]
    ),
    offload=st.booleans(),
    use_orig_params=st.booleans(),
    accumulate=st.booleans(),
    pending=st.booleans(),
    force_full_precision=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_configuration_averages(
    strategy: ShardingStrategy,
    shard: int,
    replicate: int,
    sizes: list[int],
    orig: torch.dtype,
    mp: MixedPrecision,
    hook: CommHook,
    division: Division,
    offload: bool,
    use_orig_params: bool,
    accumulate: bool,
    pending: bool,
    force_full_precision: bool,
    seed: int,
) -> None:
    mesh = Mesh(strategy, shard, replicate if strategy in HYBRID else 1)
    compute = orig if force_full_precision or mp.param_dtype is None else mp.param_dtype
    if force_full_precision:
        reduce = orig
    elif hook in (CommHook.FP16_COMPRESS, CommHook.BF16_COMPRESS):
        reduce = compute
    else:
        reduce = mp.reduce_dtype or compute
    handed = reduce if mp.keep_low_precision_grads and not force_full_precision else orig
    wire = {CommHook.FP16_COMPRESS: F16, CommHook.BF16_COMPRESS: BF16}.get(hook, reduce)

    params = tuple((f"p{i}", (n,)) for i, n in enumerate(sizes))
    offsets, total = [], 0
    for n in sizes:
        if use_orig_params:
            total += -total % ALIGNMENT_NUMEL[compute]
        offsets.append(total)
        total += n
    layout = FlatParamLayout.of(params, orig, align=use_orig_params, align_dtype=compute)
    try:
        request = PlanRequest(
            layout=layout,
            sharding=mesh.spec(),
            mixed_precision=mp,
            offload=CPUOffload(offload_params=offload),
            comm_hook=hook,
            division=division,
            use_orig_params=use_orig_params,
            flags=StepFlags(
                accumulate=accumulate, pending_unsharded=pending, force_full_precision=force_full_precision
            ),
        )
    except ValueError:
        assume(False)
    grads = make_grads(mesh.world, total, compute, seed=seed)
    pending_grads = make_grads(mesh.world, total, compute, seed=seed + 1) if pending else None
    existing = make_grads(mesh.world, shard_numel(mesh, total), handed, seed=seed + 2) if accumulate else None
    result = run(request, grads, pending_unsharded=pending_grads, sharded_grads=existing)

    precision = lowest_precision({compute, reduce, wire, handed})
    destination = (
        Destination.CPU_GRAD if offload else Destination.ACCUMULATED_GRAD if accumulate else Destination.SHARDED_GRAD
    )
    summed_grads = summed(grads, pending_grads) if pending_grads is not None else grads
    full = mean_over_world(summed_grads, division.factor)
    assert_averaged(
        result,
        mesh,
        full,
        precision=precision,
        dtype=handed,
        destination=destination,
        device=Device.HOST if offload else Device.DEVICE,
        existing=existing,
    )
    assert [c.hook for r in result.ranks for c in r.hook_calls] == (
        [] if hook is CommHook.NONE else [hook] * mesh.world
    )
    if use_orig_params and not accumulate:
        case = LayoutCase("generated", params, tuple(offsets), total)
        assert_views_rebuild_the_params(result, mesh, case, full, precision)


@budget(100)
@given(
    strategy=st.sampled_from(list(SS)),
    shard=st.integers(1, 4),
    replicate=st.integers(1, 3),
    numel=st.integers(1, 20),
    mp=st.sampled_from(
        [
            MixedPrecision(),
            MixedPrecision(param_dtype=BF16, reduce_dtype=F32),
            MixedPrecision(param_dtype=F16, keep_low_precision_grads=True),
        ]
    ),
    hook=st.sampled_from([CommHook.NONE, CommHook.ALLREDUCE, CommHook.USER, CommHook.BF16_COMPRESS]),
    division=st.sampled_from(
        [
            Division(),
            Division(factor=3.0),
            Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL),
            Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=7.0),
            Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO),
        ]
    ),
    offload=st.booleans(),
    accumulate=st.booleans(),
    no_sync_steps=st.integers(0, 2),
    deferred_steps=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_any_sequence_of_microbatches_averages_their_sum(
    strategy: ShardingStrategy,
    shard: int,
    replicate: int,
    numel: int,
    mp: MixedPrecision,
    hook: CommHook,
    division: Division,
    offload: bool,
    accumulate: bool,
    no_sync_steps: int,
    deferred_steps: int,
    seed: int,
) -> None:
    """``no_sync_steps`` backwards inside ``no_sync``, then (hybrid only) ``deferred_steps`` backwards
    keeping a partial, then one that reduces everything, optionally into an existing gradient."""
    mesh = Mesh(strategy, shard, replicate if strategy in HYBRID else 1)
    if strategy not in HYBRID:
        deferred_steps = 0
    compute = mp.param_dtype or F32
    reduce = compute if hook is CommHook.BF16_COMPRESS else mp.reduce_dtype or compute
    handed = reduce if mp.keep_low_precision_grads else F32
    wire = BF16 if hook is CommHook.BF16_COMPRESS else reduce
    layout = FlatParamLayout.of((("w", (numel,)),), F32)
    try:
        base = PlanRequest(
            layout=layout,
            sharding=mesh.spec(),
            mixed_precision=mp,
            offload=CPUOffload(offload_params=offload),
            comm_hook=hook,
            division=division,
        )
    except ValueError:
        assume(False)
    steps = [StepFlags(sync_gradients=False, pending_unsharded=i > 0) for i in range(no_sync_steps)]
    steps += [
        StepFlags(requires_all_reduce=False, pending_unsharded=i == 0 and no_sync_steps > 0, pending_partial=i > 0)
        for i in range(deferred_steps)
    ]
    steps.append(
        StepFlags(
            accumulate=accumulate,
            pending_unsharded=no_sync_steps > 0 and deferred_steps == 0,
            pending_partial=deferred_steps > 0,
        )
    )
    all_grads = [make_grads(mesh.world, numel, compute, seed=seed + i) for i in range(len(steps))]
    existing = make_grads(mesh.world, shard_numel(mesh, numel), handed, seed=seed - 1) if accumulate else None
    carried: Sequence[Tensor] | None = None
    for flags, grads in zip(steps[:-1], all_grads):
        result = run(
            replace(base, flags=flags),
            grads,
            pending_unsharded=carried if flags.pending_unsharded else None,
            partials=carried if flags.pending_partial else None,
        )
        carried = result.grads
    final = steps[-1]
    result = run(
        replace(base, flags=final),
        all_grads[-1],
        pending_unsharded=carried if final.pending_unsharded else None,
        partials=carried if final.pending_partial else None,
        sharded_grads=existing,
    )
    destination = (
        Destination.CPU_GRAD if offload else Destination.ACCUMULATED_GRAD if accumulate else Destination.SHARDED_GRAD
    )
    assert_averaged(
        result,
        mesh,
        mean_over_world(summed(*all_grads), division.factor),
        precision=lowest_precision({compute, reduce, wire, handed}),
        dtype=handed,
        destination=destination,
        device=Device.HOST if offload else Device.DEVICE,
        existing=existing,
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
