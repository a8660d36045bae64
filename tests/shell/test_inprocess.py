"""The in-process world's ranks meet as ``torch.distributed`` says they do: its process groups
under ``torch.distributed``'s own functions, values worked out by hand; a reduction rounds once;
a rank that never comes, a different collective or a failing rank ends the world with an error
instead of a hang. (What plans compute on it: ``test_simulated_world_*.py``.)"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _make_nccl_premul_sum

from fsdp_core import Group, ReduceKind, ReduceOpSpec, Stream
from fsdp_shell.runtime.collectives import any_rank
from fsdp_shell.runtime.inprocess import (
    InProcessRuntime,
    InProcessWorld,
    SimulationError,
    WorldAborted,
    WorldGeometry,
)


def on_ranks(world: InProcessWorld, body: Callable[[int], object]) -> list[object]:
    """``body(rank)`` on a thread per rank; every rank's result or exception, by rank."""
    out: list[object] = [None] * world.geometry.world_size

    def main(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except Exception as error:  # noqa: BLE001  # returned to the test
            out[rank] = error
            world.fail(rank, error)

    threads = [threading.Thread(target=main, args=(g,)) for g in range(world.geometry.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return out


def world_of(shard: int, replicate: int = 1, timeout: float = 30.0) -> InProcessWorld:
    return InProcessWorld(WorldGeometry(shard_size=shard, replicate_size=replicate), timeout=timeout)


@pytest.mark.parametrize(
    ("op", "want"),
    [
        (dist.ReduceOp.SUM, [6.0, 60.0]),
        (dist.ReduceOp.AVG, [2.0, 20.0]),
        (dist.ReduceOp.MAX, [3.0, 30.0]),
        (_make_nccl_premul_sum(0.5), [3.0, 30.0]),
    ],
    ids=["sum", "avg", "max", "premul-half"],
)
def test_all_reduce_over_three_ranks(op: dist.ReduceOp, want: list[float]) -> None:
    world = world_of(3)

    def body(rank: int) -> list[float]:
        t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        dist.all_reduce(t, op=op, group=world.groups(rank).shard)
        return t.tolist()

    assert on_ranks(world, body) == [want] * 3


def test_reduce_scatter_and_all_gather_by_group_order() -> None:
    """Ranks 0-3 as a 2 x 2 mesh: the shard groups are {0, 1} and {2, 3}, the replicate groups
    {0, 2} and {1, 3}."""
    world = world_of(2, replicate=2)

    def body(rank: int) -> tuple[list[float], list[float], list[float]]:
        groups = world.groups(rank)
        src = torch.arange(4.0) + 100 * rank
        mine = torch.empty(2)
        # torch 2.13's names: the old ones warn, and ``warnings.catch_warnings`` is not thread-safe
        dist.reduce_scatter_single(mine, src, group=groups.shard)
        whole = torch.empty(4)
        dist.all_gather_single(whole, mine, group=groups.of(Group.REPLICATE))
        across = torch.tensor([float(rank)])
        dist.all_reduce(across, group=groups.of(Group.REPLICATE))
        return mine.tolist(), whole.tolist(), across.tolist()

    got = on_ranks(world, body)
    # shard group {0, 1}: [0,1,2,3] + [100,101,102,103]; {2, 3}: [200..203] + [300..303]
    assert [g[0] for g in got] == [[100.0, 102.0], [104.0, 106.0], [500.0, 502.0], [504.0, 506.0]]  # type: ignore[index]
    assert [g[1] for g in got] == [[100.0, 102.0, 500.0, 502.0], [104.0, 106.0, 504.0, 506.0]] * 2  # type: ignore[index]
    assert [g[2] for g in got] == [[2.0], [4.0], [2.0], [4.0]]  # type: ignore[index]


def test_a_low_precision_reduction_rounds_once() -> None:
    """In bfloat16 (8 significant bits) 1 + 2**-8 rounds back to 1, so summing step by step
    gives 1; the float32 sum, 1 + 2**-7, is a bfloat16 and is what every rank gets."""
    world = world_of(3)

    def body(rank: int) -> float:
        t = torch.tensor([1.0 if rank == 0 else 2.0**-8], dtype=torch.bfloat16)
        dist.all_reduce(t, group=world.groups(rank).shard)
        return float(t)

    step_by_step = torch.tensor([1.0], dtype=torch.bfloat16) + torch.tensor([2.0**-8], dtype=torch.bfloat16)
    assert float(step_by_step) == 1.0
    assert on_ranks(world, body) == [1.0 + 2.0**-7] * 3


def test_a_library_collective_runs_on_it() -> None:
    world = world_of(2)
    assert on_ranks(world, lambda rank: any_rank(rank == 1, world.groups(rank).shard, torch.device("cpu"))) == [
        True,
        True,
    ]


def test_the_runtime_issues_through_its_groups_and_records_each_call() -> None:
    world = world_of(2)

    def body(rank: int) -> tuple[list[float], list[float], int]:
        runtime = InProcessRuntime(world.groups(rank))
        src = runtime.empty(4, torch.float32, torch.device("cpu"), Stream.POST_BACKWARD)
        runtime.compute(Stream.POST_BACKWARD, lambda: src.copy_(torch.arange(4.0) * (rank + 1)), (src,))
        dst = runtime.empty(2, torch.float32, torch.device("cpu"), Stream.POST_BACKWARD)
        runtime.reduce_scatter(Stream.POST_BACKWARD, Group.SHARD, dst, src, ReduceOpSpec(), src_dies=True)
        gathered = torch.empty(4)
        assert runtime.all_gather(gathered, dst) is None
        runtime.free_marker().wait()
        assert runtime.to_host(Stream.POST_BACKWARD, dst, lambda: torch.empty(2)) is dst
        return dst.tolist(), gathered.tolist(), len(runtime.issued)

    # [0, 1, 2, 3] + [0, 2, 4, 6] = [0, 3, 6, 9]
    assert on_ranks(world, body) == [([0.0, 3.0], [0.0, 3.0, 6.0, 9.0], 1), ([6.0, 9.0], [0.0, 3.0, 6.0, 9.0], 1)]


def test_ranks_issuing_different_collectives_all_fail() -> None:
    world = world_of(2)

    def body(rank: int) -> None:
        t = torch.ones(3 if rank == 0 else 4)
        dist.all_reduce(t, group=world.groups(rank).shard)

    got = on_ranks(world, body)
    assert all(isinstance(e, SimulationError) and "different collectives" in str(e) for e in got), got


def test_a_rank_that_never_comes_is_named() -> None:
    world = world_of(2, timeout=0.2)

    def body(rank: int) -> None:
        if rank == 0:
            dist.all_reduce(torch.ones(1), group=world.groups(rank).shard)

    (waiting, _) = on_ranks(world, body)
    assert isinstance(waiting, SimulationError) and "ranks [1] never reached collective 0" in str(waiting)


def test_a_failing_rank_releases_the_ranks_waiting_for_it() -> None:
    world = world_of(3)

    def body(rank: int) -> None:
        if rank == 2:
            raise ValueError("rank 2 broke")
        dist.all_reduce(torch.ones(1), group=world.groups(rank).shard)

    got = on_ranks(world, body)
    assert isinstance(got[2], ValueError)
    assert all(isinstance(e, WorldAborted) for e in got[:2]), got


def test_a_reduce_op_no_plan_uses_is_refused() -> None:
    world = world_of(2)

    def body(rank: int) -> None:
        dist.all_reduce(torch.ones(1), op=dist.ReduceOp.PRODUCT, group=world.groups(rank).shard)

    got = on_ranks(world, body)
    assert all(isinstance(e, SimulationError) and "not one the plans use" in str(e) for e in got), got


def test_a_reduce_scatter_into_the_wrong_size_is_refused() -> None:
    world = world_of(2)
    group = world.groups(0).shard
    with pytest.raises(SimulationError, match=r"cannot reduce-scatter 4 x torch\.float32 into 3"):
        InProcessRuntime(world.groups(0)).reduce_scatter(
            Stream.POST_BACKWARD,
            Group.SHARD,
            torch.empty(3),
            torch.ones(4),
            ReduceOpSpec(kind=ReduceKind.SUM),
            src_dies=False,
        )
    assert group.size() == 2 and group.rank() == 0
