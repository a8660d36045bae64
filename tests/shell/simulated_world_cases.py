"""Worlds, layouts and expected values shared by the simulated-world tests (``test_simulated_world_*.py``).

Meshes, flat-parameter layouts with their offsets and total numels, FSDP1's pre-divide factors
and which strategies free the parameter inside ``no_sync`` are written out by hand. Expected
values are computed here with plain torch, in float64, from the gradients handed to the ranks:
the sum over every data-parallel rank, divided by the world size (or the user's factor),
zero-padded to a multiple of the shard group size, sliced to the rank's shard. Nothing expected
is computed by the planner, the layout or the division code under test. ``run`` simulates a
request after proving every rank's plan sound; ``assert_averaged`` and
``assert_views_rebuild_the_params`` compare what every rank was handed with those values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fsdp_core import (
    BackendCaps,
    CommHook,
    CPUOffload,
    Destination,
    Device,
    Division,
    FlatParamLayout,
    MixedPrecision,
    PlanRequest,
    ShardingSpec,
    ShardingStrategy,
    StepFlags,
    check_plan,
)
from fsdp_shell.runtime.simulate import WorldResult, simulate

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


# -- use_orig_params views ----------------------------------------------------------------


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
