"""The simulated timeline: per-stream order, waits honoured, hybrid all-reduce overlap."""

from __future__ import annotations

import pytest
import torch

from fsdp_core import (
    CostModel,
    FlatParamLayout,
    ShardingSpec,
    ShardingStrategy,
    Stream,
    TimelineEntry,
    format_timeline,
    plan_post_backward,
    simulate_timeline,
)

LAYOUT = FlatParamLayout.of([("w", (8_000_000,))], torch.float32)
COST = CostModel(device_bandwidth=1e12, shard_link_bandwidth=1e11, replicate_link_bandwidth=1e10,
                 host_bandwidth=1e10, collective_latency=0.0)


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
        assert all(a.end <= b.start + 1e-15 for a, b in zip(mine, mine[1:]))
    ar0, rs0, rs1 = find(entries, 0, "all_reduce"), find(entries, 0, "reduce_scatter"), find(entries, 1, "reduce_scatter")
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
    with pytest.raises(ValueError, match="shard_link_bandwidth"):
        CostModel(shard_link_bandwidth=0)
