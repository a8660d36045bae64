"""The simulated timeline: per-stream order, waits honoured, hybrid all-reduce overlap, and the
backward all-gathers of an all-gather schedule."""

from __future__ import annotations

import itertools

import pytest
import torch

from fsdp_core import (
    BackwardPrefetch,
    FlatParamLayout,
    Group,
    MixedPrecision,
    ShardingSpec,
    ShardingStrategy,
    Stream,
    UnshardRequest,
    UnshardSchedule,
    all_gather_volume,
    plan_post_backward,
    plan_unshard,
)
from fsdp_core.sim import CostModel, TimelineEntry, format_timeline, simulate_timeline

LAYOUT = FlatParamLayout.of([("w", (8_000_000,))], torch.float32)
COST = CostModel(
    device_bandwidth=1e12,
    intra_node_bandwidth=1e11,
    inter_node_bandwidth=1e10,
    host_bandwidth=1e10,
    collective_latency=0.0,
)


def find(entries: tuple[TimelineEntry, ...], unit: int, op: str) -> TimelineEntry:
    return next(e for e in entries if e.unit == unit and e.op == op)


def test_reduce_scatter_time_follows_the_cost_model() -> None:
    plan = plan_post_backward(LAYOUT, ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 8))
    rs = find(simulate_timeline(plan, COST), 0, "reduce_scatter")
    # 7 chunks of 1e6 fp32 elements leave each rank: 28e6 bytes over 1e11 B/s = 280 us.
    assert rs.end - rs.start == pytest.approx(28e6 / 1e11)


def test_streams_run_in_order_and_hybrid_all_reduce_overlaps_the_next_reduce_scatter() -> None:
    plan = plan_post_backward(LAYOUT, ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 16, 8))
    entries = simulate_timeline(plan, COST, units=2, backward_seconds=1e-4)
    for stream in Stream:
        mine = [e for e in entries if e.stream is stream]
        assert all(a.end <= b.start + 1e-15 for a, b in itertools.pairwise(mine))
    ar0, rs0, rs1 = (
        find(entries, 0, "all_reduce"),
        find(entries, 0, "reduce_scatter"),
        find(entries, 1, "reduce_scatter"),
    )
    assert ar0.start >= rs0.end
    assert ar0.stream is Stream.ALL_REDUCE and rs1.stream is Stream.POST_BACKWARD
    assert rs1.start < ar0.end and ar0.start < rs1.end
    assert "A" in format_timeline(entries) and "unit 1" in format_timeline(entries)


def test_end_of_backward_waits_for_every_stream() -> None:
    plan = plan_post_backward(LAYOUT, ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 16, 8))
    entries = simulate_timeline(plan, COST, units=3)
    hand_off = next(e for e in entries if e.op == "hand_off")
    assert hand_off.start >= max(e.end for e in entries if e.op != "hand_off")


def test_bad_arguments() -> None:
    plan = plan_post_backward(LAYOUT, ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 2))
    with pytest.raises(ValueError, match="units"):
        simulate_timeline(plan, units=0)
    with pytest.raises(ValueError, match="intra_node_bandwidth"):
        CostModel(intra_node_bandwidth=0)


def _chain(prefetch: BackwardPrefetch | None, units: int = 4, reshard_after_forward: bool = True) -> UnshardSchedule:
    return plan_unshard(
        UnshardRequest.chain(
            units, reshard_after_forward=reshard_after_forward, plan_reshards=True, backward_prefetch=prefetch
        )
    )


# 8e6 fp32 elements over 8 ranks: each rank receives 7 shards of 1e6 elements = 28e6 B, 280 us at 1e11 B/s;
# the reduce-scatter sends as much. Each unit's backward takes 300 us.
GATHER = 28e6 / 1e11
BACKWARD = 3e-4


def test_without_a_schedule_there_are_no_all_gathers() -> None:
    plan = plan_post_backward(LAYOUT, ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 8))
    entries = simulate_timeline(plan, COST, units=4, backward_seconds=BACKWARD)
    assert all(e.stream is not Stream.ALL_GATHER for e in entries)
    assert "all_gather" not in format_timeline(entries)


def test_no_prefetch_gathers_each_unit_in_its_own_slot() -> None:
    plan = plan_post_backward(LAYOUT, ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 8))
    entries = simulate_timeline(plan, COST, units=4, backward_seconds=BACKWARD, unshard=_chain(None))
    gathers = [e for e in entries if e.op == "all_gather"]
    assert [e.unit for e in gathers] == [3, 2, 1]  # the root keeps its parameter from forward
    assert all(e.stream is Stream.ALL_GATHER and e.end - e.start == pytest.approx(GATHER) for e in gathers)
    root = find(entries, 0, "backward")
    assert root.start == 0.0 and root.end == pytest.approx(BACKWARD)
    # Unit 3's all-gather is issued when its pre-backward fires, at the end of the root's backward.
    assert find(entries, 3, "all_gather").start == pytest.approx(BACKWARD)
    for unit in (3, 2, 1):
        assert find(entries, unit, "backward").start == pytest.approx(find(entries, unit, "all_gather").end)
    # One communicator: unit 2's all-gather queues behind unit 3's reduce-scatter, issued before it.
    assert find(entries, 2, "all_gather").start == pytest.approx(find(entries, 3, "reduce_scatter").end)
    # The root's post-backward fires last.
    assert find(entries, 0, "reduce_scatter").start >= find(entries, 1, "reduce_scatter").end
    text = format_timeline(entries)
    assert "G all-gather" in text and "  all_gather    |" in text


def test_backward_pre_overlaps_the_next_all_gather_with_this_backward() -> None:
    plan = plan_post_backward(LAYOUT, ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 8))
    schedule = _chain(BackwardPrefetch.BACKWARD_PRE)
    entries = simulate_timeline(plan, COST, units=4, backward_seconds=BACKWARD, unshard=schedule)
    # The root's pre-backward prefetches unit 3 at time 0, unit 3's prefetches unit 2 when its backward
    # starts; each all-gather (280 us) hides behind a backward (300 us), so no backward waits.
    assert find(entries, 3, "all_gather").start == 0.0
    assert find(entries, 3, "backward").start == pytest.approx(BACKWARD)
    assert find(entries, 2, "all_gather").start == pytest.approx(BACKWARD)
    assert find(entries, 2, "backward").start == pytest.approx(2 * BACKWARD)
    # Unit 2's pre-backward fires after unit 3's post-backward issued its reduce-scatter: unit 1's
    # all-gather queues behind it on the shard group.
    assert find(entries, 1, "all_gather").start == pytest.approx(find(entries, 3, "reduce_scatter").end)
    total = {
        p: max(e.end for e in simulate_timeline(plan, COST, units=4, backward_seconds=BACKWARD, unshard=_chain(p)))
        for p in (None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST)
    }
    assert total[BackwardPrefetch.BACKWARD_PRE] < total[None]
    # Here a unit's post-backward and the next pre-backward fire at the same instant.
    assert total[BackwardPrefetch.BACKWARD_POST] == pytest.approx(total[None])


def test_units_kept_from_forward_are_not_gathered_in_backward() -> None:
    plan = plan_post_backward(LAYOUT, ShardingSpec.for_world(ShardingStrategy.SHARD_GRAD_OP, 8))
    schedule = _chain(BackwardPrefetch.BACKWARD_PRE, reshard_after_forward=False)
    entries = simulate_timeline(plan, COST, units=4, backward_seconds=BACKWARD, unshard=schedule)
    assert all(e.op != "all_gather" for e in entries)


def test_the_schedule_must_cover_the_units() -> None:
    plan = plan_post_backward(LAYOUT, ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 8))
    with pytest.raises(ValueError, match="unshard"):
        simulate_timeline(plan, units=3, unshard=_chain(None, units=4))


def test_all_gather_volume_worked_by_hand() -> None:
    w1001 = FlatParamLayout.of([("w", (1001,))], torch.float32)
    full = plan_post_backward(w1001, ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 8)).request
    v = all_gather_volume(full)
    assert v is not None
    assert (v.collective, v.group, v.group_size, v.input_numel, v.output_numel, v.dtype, v.bytes) == (
        "all_gather",
        Group.SHARD,
        8,
        126,
        1008,
        torch.float32,
        7 * 126 * 4,
    )
    bf16 = plan_post_backward(
        w1001,
        ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 32, 8),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
    ).request
    v = all_gather_volume(bf16)
    assert v is not None and (v.group_size, v.dtype, v.bytes) == (8, torch.bfloat16, 7 * 126 * 2)
    no_shard = plan_post_backward(w1001, ShardingSpec.for_world(ShardingStrategy.NO_SHARD, 8)).request
    assert all_gather_volume(no_shard) is None
    alone = all_gather_volume(plan_post_backward(w1001, ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 1)).request)
    assert alone is not None and (alone.output_numel, alone.bytes) == (1001, 0)
