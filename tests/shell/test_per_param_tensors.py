"""A per-parameter unit's tensors move as its layout says: every rank's copy-in into one buffer
leaves what the all-gather leaves, and the copy-out gives every parameter back, for shards on
dimension 0 (uneven, ranks without rows) and on another dimension. (On real ranks, against
PyTorch's ``fully_shard``: ``tests/worlds/test_per_param_gloo.py``.)"""

from __future__ import annotations

import pytest
import torch

from fsdp_core import PerParamLayout
from fsdp_shell.units.per_param import copy_in, copy_in_grads, copy_out, padded_shard, sharded_grads


def test_a_padded_shard_by_hand() -> None:
    """5 rows over 2 ranks: rank 1 holds rows 3 and 4 and one row of zeros."""
    layout = PerParamLayout.of([("w", (5, 2))], torch.float32, 2)
    full = torch.arange(10.0).view(5, 2)
    assert padded_shard(layout, 0, full, 1).tolist() == [[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]]


def test_the_copy_in_lands_in_the_ranks_slice_by_hand() -> None:
    """Two parameters, 2 ranks: rank 1's slice starts at 3 + 1 = 4 and holds its chunk of each."""
    layout = PerParamLayout.of([("w", (3,)), ("b", (2,))], torch.float32, 2)
    out = torch.full((layout.padded_numel,), -1.0)
    mine = copy_in(layout, [torch.tensor([7.0, 0.0]), torch.tensor([8.0])], out, 1)
    assert out.tolist() == [-1.0, -1.0, -1.0, 7.0, 0.0, 8.0]
    assert mine.data_ptr() == out[3:].data_ptr()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_ranks_copy_in_then_the_copy_out_gives_the_parameters_back(world: int) -> None:
    specs = [("a", (5, 3), 0), ("b", (7,), 0), ("c", (2, 12), 1), ("d", (1, 4), 0)]
    layout = PerParamLayout.of(specs, torch.float32, world)
    torch.manual_seed(world)
    full = [torch.randn(shape) for _, shape, _ in specs]
    gathered = torch.full((layout.padded_numel,), float("nan"))
    for rank in range(world):
        copy_in(layout, [padded_shard(layout, i, f, rank) for i, f in enumerate(full)], gathered, rank)
    assert not gathered.isnan().any(), "every element is some rank's"
    back = copy_out(layout, gathered)
    assert [tuple(b.shape) for b in back] == [shape for _, shape, _ in specs]
    assert all(torch.equal(a, b) for a, b in zip(full, back))


def test_tensors_of_the_wrong_size_are_refused_by_name() -> None:
    layout = PerParamLayout.of([("w", (3,)), ("b", (2,))], torch.float32, 2)
    with pytest.raises(ValueError, match=r"full: expected the shape of 'w', \(3,\), got \(4,\)"):
        padded_shard(layout, 0, torch.zeros(4), 0)
    with pytest.raises(ValueError, match=r"shards: expected one per parameter \(2\), got 1"):
        copy_in(layout, [torch.zeros(2)], torch.zeros(6), 0)
    with pytest.raises(ValueError, match=r"out: expected 6 elements \(world x slice\), got 5"):
        copy_in(layout, [torch.zeros(2), torch.zeros(1)], torch.zeros(5), 0)
    with pytest.raises(ValueError, match=r"gathered: expected 6 elements \(world x slice\), got 7"):
        copy_out(layout, torch.zeros(7))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_ranks_gradient_copy_in_summed_gives_each_rank_its_chunk_of_the_sum(world: int) -> None:
    """The reduce side: each rank copies its unsharded gradients in (bf16 into fp32, as with an
    fp32 reduce dtype); the buffers summed over ranks and split by rank are what a summing
    reduce-scatter leaves; each rank's sharded gradients are its ``torch.chunk`` of the summed
    gradients, empty where it holds no rows."""
    specs = [("a", (5, 3), 0), ("b", (7,), 0), ("c", (2, 12), 1), ("d", (1, 4), 0)]
    layout = PerParamLayout.of(specs, torch.float32, world)
    torch.manual_seed(world)
    grads = [[torch.randn(shape).to(torch.bfloat16) for _, shape, _ in specs] for _ in range(world)]
    total = torch.zeros(layout.padded_numel)
    for rank in range(world):
        mine = torch.full((layout.padded_numel,), float("nan"))
        copy_in_grads(layout, grads[rank], mine)
        total += mine
    summed = [torch.zeros(shape) for _, shape, _ in specs]
    for rank_grads in grads:  # in rank order from zero, as the buffers are summed
        for acc, g in zip(summed, rank_grads):
            acc.add_(g.float())
    for rank in range(world):
        reduced = total[rank * layout.slice_numel : (rank + 1) * layout.slice_numel]
        for i, got in enumerate(sharded_grads(layout, reduced, rank)):
            (_, _, dim) = specs[i]
            chunks = torch.chunk(summed[i], world, dim=dim)
            want = chunks[rank] if rank < len(chunks) else summed[i].narrow(dim, 0, 0)
            assert torch.equal(got, want), (rank, specs[i][0])


def test_gradients_of_the_wrong_size_are_refused_by_name() -> None:
    layout = PerParamLayout.of([("w", (3,)), ("b", (2,))], torch.float32, 2)
    with pytest.raises(ValueError, match=r"grads: expected the shape of 'b', \(2,\), got \(3,\)"):
        copy_in_grads(layout, [torch.zeros(3), torch.zeros(3)], torch.zeros(6))
    with pytest.raises(ValueError, match=r"reduced: expected 3 elements \(one rank's slice\), got 6"):
        sharded_grads(layout, torch.zeros(6), 0)
