"""Per-parameter (``fully_shard``) plans over a simulated world: every rank of 1-D and 2-D meshes
runs its plan under the interpreter that trains, and hands off each parameter's ``torch.chunk``
of the gradient averaged over the world, as PyTorch's FSDP2 does, and exposes exactly that chunk
as the parameter's gradient view; a ``no_sync`` backward keeps each rank's own gradients in the
reduce dtype, and the next synchronised one reduces their sum.

Expected values are plain torch in float64: the ranks' gradients are averaged and each parameter
cut with ``torch.chunk`` along its shard dimension, padded with zeros to the largest chunk;
nothing expected is computed by the layout, planner or interpreter under test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from fsdp_core import (
    BackendCaps,
    Destination,
    Division,
    DivisionPolicy,
    MixedPrecision,
    PerParamLayout,
    PlanRequest,
    ShardingSpec,
    ShardingStrategy,
    StepFlags,
    check_plan,
)
from fsdp_shell.runtime.simulate import WorldResult, simulate

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
PARAMS: tuple[tuple[str, tuple[int, ...], int], ...] = (
    ("w", (5, 3), 0),  # 5 rows: uneven on 2 and 4 ranks (4 ranks: chunks of 2, 2, 1 and none)
    ("b", (5,), 0),
    ("v", (4, 8), 1),  # sharded on its columns, which divide
    ("s", (1,), 0),  # one row: every rank but the first holds none
)
GLOO = Division(policy=DivisionPolicy.IN_COLLECTIVE)
NCCL = Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=BackendCaps.for_backend("nccl"))
MESHES = [
    (ShardingStrategy.FULL_SHARD, 1, 1),
    (ShardingStrategy.FULL_SHARD, 2, 1),
    (ShardingStrategy.FULL_SHARD, 4, 1),
    (ShardingStrategy.SHARD_GRAD_OP, 4, 1),
    (ShardingStrategy.HYBRID_SHARD, 2, 2),
    (ShardingStrategy.HYBRID_SHARD_ZERO2, 1, 2),
]


def request(strategy: ShardingStrategy, shard: int, replicate: int, **kw: object) -> PlanRequest:
    layout = PerParamLayout.of(PARAMS, F32, shard)
    sharding = ShardingSpec(strategy=strategy, shard_size=shard, replicate_size=replicate)
    return PlanRequest(layout=layout, sharding=sharding, **kw)  # type: ignore[arg-type]  # the options under test


def grads(world: int, seed: int, dtype: torch.dtype = F32) -> list[Tensor]:
    """Each rank's gradients, flattened end to end in parameter order."""
    gen = torch.Generator().manual_seed(seed)
    numel = sum(math.prod(shape) for _, shape, _ in PARAMS)
    return [torch.randn(numel, generator=gen, dtype=F64).to(dtype) for _ in range(world)]


def chunks(flat: Tensor, shard: int, rank: int) -> list[tuple[Tensor, int]]:
    """Each parameter's chunk of ``flat`` (end to end in parameter order) that ``rank`` holds, as
    ``torch.chunk`` cuts it, flattened (stacked chunks first for another dimension), with the
    largest chunk's numel (every rank's padded size)."""
    out, start = [], 0
    for _, shape, dim in PARAMS:
        numel = math.prod(shape)
        whole = flat[start : start + numel].view(shape)
        start += numel
        rows = -(-shape[dim] // shard)
        pieces = torch.chunk(whole, shard, dim=dim) if shape[dim] else ()
        mine = pieces[rank].contiguous().view(-1) if rank < len(pieces) else whole.new_zeros(0)
        out.append((mine, rows * numel // shape[dim]))
    return out


def padded_slice(flat: Tensor, shard: int, rank: int) -> Tensor:
    return torch.cat([torch.cat([c, c.new_zeros(size - c.numel())]) for c, size in chunks(flat, shard, rank)])


def run(r: PlanRequest, given: Sequence[Tensor], **inputs: Sequence[Tensor]) -> WorldResult:
    result = simulate(r, given, **inputs)  # type: ignore[arg-type]  # carried inputs by name
    for rank in result.ranks:
        assert check_plan(rank.plan) == []
        assert rank.live_buffers == ()
    return result


def assert_chunks_of(result: WorldResult, mean: Tensor, shard: int, tol: float) -> None:
    for g, rank in enumerate(result.ranks):
        assert rank.grad is not None and rank.destination is Destination.SHARDED_GRAD and rank.grad.dtype == F32
        torch.testing.assert_close(rank.grad.double(), padded_slice(mean, shard, g % shard), rtol=tol, atol=tol)
        held = {name: c for (name, _, _), (c, _) in zip(PARAMS, chunks(mean, shard, g % shard)) if c.numel()}
        assert [v.param_name for v in rank.views] == list(held)
        for v in rank.views:
            torch.testing.assert_close(v.tensor.double(), held[v.param_name], rtol=tol, atol=tol)
            assert v.tensor.data_ptr() >= rank.grad.data_ptr()  # a view of the handed-off shard


@pytest.mark.parametrize("division", [GLOO, NCCL], ids=["sum-then-divide", "avg"])
@pytest.mark.parametrize(("strategy", "shard", "replicate"), MESHES, ids=[f"{s.name}-{n}x{m}" for s, n, m in MESHES])
def test_every_rank_gets_each_parameters_chunk_of_the_average(
    strategy: ShardingStrategy, shard: int, replicate: int, division: Division
) -> None:
    given = grads(shard * replicate, seed=shard + 10 * replicate)
    result = run(request(strategy, shard, replicate, division=division), given)
    assert_chunks_of(result, torch.stack([g.double() for g in given]).mean(0), shard, 1e-6)


def test_bf16_gradients_are_reduced_in_fp32_and_handed_off_in_the_parameters_dtype() -> None:
    given = grads(4, seed=7, dtype=BF16)
    r = request(ShardingStrategy.HYBRID_SHARD, 2, 2, mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=F32))
    result = run(r, given)
    assert_chunks_of(result, torch.stack([g.double() for g in given]).mean(0), 2, 1e-6)


def test_no_sync_keeps_each_ranks_own_gradients_then_the_synced_backward_reduces_the_sum() -> None:
    mp = MixedPrecision(param_dtype=BF16, reduce_dtype=F32)
    first, second = grads(4, seed=1, dtype=BF16), grads(4, seed=2, dtype=BF16)
    kept = run(
        request(ShardingStrategy.FULL_SHARD, 4, 1, mixed_precision=mp, flags=StepFlags(sync_gradients=False)), first
    )
    for rank, g in zip(kept.ranks, first):
        assert rank.destination is Destination.UNSHARDED_GRAD and rank.grad is not None
        assert rank.grad.dtype == F32 and torch.equal(rank.grad, g.float())  # exact: a widening cast
        assert rank.views == ()  # the parameters' .grad is left as it was
    pending = [rank.grad for rank in kept.ranks if rank.grad is not None]
    synced = run(
        request(ShardingStrategy.FULL_SHARD, 4, 1, mixed_precision=mp, flags=StepFlags(pending_unsharded=True)),
        second,
        pending_unsharded=pending,
    )
    total = torch.stack([a.double() + b.double() for a, b in zip(first, second)]).mean(0)
    assert_chunks_of(synced, total, 4, 1e-6)
