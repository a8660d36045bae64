"""One iteration of a small model (``iteration_cases.small``): stream order, the sync and async
replicate all-reduce, prefetch, link sharing and slowdowns, bad models refused, the plans
deciding streams and links, exposed communication and the limiting link. Expected times are
worked out by hand.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from fsdp_core import BackwardPrefetch, Stream
from fsdp_core.sim import (
    SEED_ROWS,
    Activity,
    CollectiveCosts,
    ComputeSlowdown,
    IterationModel,
    LinkModel,
    UnitCosts,
    seed_model,
    simulate_iteration,
)
from tests.core.iteration_cases import FSDP, HSDP_ASYNC, HSDP_SYNC, INTER, INTRA, NOTHING, at, plans_of, small


def test_hsdp_async_by_hand() -> None:
    t = simulate_iteration(small(HSDP_ASYNC))
    # Forward: no forward prefetch, so each all-gather is issued when the previous forward ends.
    assert at(t, Activity.FORWARD_ALL_GATHER, 1) == (0, 3) and at(t, Activity.FORWARD, 1) == (3, 4)
    assert at(t, Activity.FORWARD_ALL_GATHER, 2) == (4, 7) and at(t, Activity.FORWARD, 2) == (7, 8)
    # Backward: the root's pre-backward issues u2's all-gather, u2's pre-backward u1's (BACKWARD_PRE).
    assert at(t, Activity.BACKWARD_ALL_GATHER, 2) == (8, 11)
    assert at(t, Activity.BACKWARD_ALL_GATHER, 1) == (11, 14)
    assert at(t, Activity.BACKWARD, 2) == (11, 13)
    # u2's reduce-scatter waits for its backward, and on the shard group for u1's all-gather.
    assert at(t, Activity.REDUCE_SCATTER, 2) == (14, 17)
    assert at(t, Activity.ALL_REDUCE, 2) == (17, 37)
    assert at(t, Activity.BACKWARD, 1) == (14, 16)
    assert at(t, Activity.REDUCE_SCATTER, 1) == (17, 20)
    assert at(t, Activity.ALL_REDUCE, 1) == (37, 57)
    assert t.iteration_ms == 57
    assert t.find(Activity.ALL_REDUCE, 1).stream is Stream.ALL_REDUCE
    assert t.find(Activity.ALL_REDUCE, 1).link is INTER and t.find(Activity.REDUCE_SCATTER, 1).link is INTRA


def test_sync_the_next_reduce_scatter_waits_for_the_all_reduce_async_does_not() -> None:
    sync = simulate_iteration(small(HSDP_SYNC))
    assert at(sync, Activity.ALL_REDUCE, 2) == (17, 37)
    assert at(sync, Activity.REDUCE_SCATTER, 1) == (37, 40)
    assert at(sync, Activity.ALL_REDUCE, 1) == (40, 60)
    assert sync.iteration_ms == 60
    assert sync.find(Activity.ALL_REDUCE, 1).stream is Stream.POST_BACKWARD
    asynchronous = simulate_iteration(small(HSDP_ASYNC))
    assert asynchronous.find(Activity.REDUCE_SCATTER, 1).start_ms < asynchronous.find(Activity.ALL_REDUCE, 2).end_ms


def test_fsdp_by_hand_all_gathers_and_reduce_scatters_take_turns_on_the_shard_group() -> None:
    t = simulate_iteration(small(FSDP))
    assert at(t, Activity.FORWARD_ALL_GATHER, 1) == (0, 10) and at(t, Activity.FORWARD_ALL_GATHER, 2) == (11, 21)
    assert at(t, Activity.BACKWARD_ALL_GATHER, 2) == (22, 32)
    assert at(t, Activity.BACKWARD_ALL_GATHER, 1) == (32, 42)
    assert at(t, Activity.BACKWARD, 2) == (32, 34)
    assert at(t, Activity.REDUCE_SCATTER, 2) == (42, 52)
    assert at(t, Activity.BACKWARD, 1) == (42, 44)
    assert at(t, Activity.REDUCE_SCATTER, 1) == (52, 62)
    assert t.iteration_ms == 62
    assert not any(i.activity is Activity.ALL_REDUCE for i in t.intervals)
    assert {i.link for i in t.intervals if i.activity.is_collective} == {INTER}


def test_fsdp_with_concurrent_collectives_shares_the_inter_node_link() -> None:
    shared = simulate_iteration(small(FSDP), LinkModel(one_collective_per_group=False))
    # u2's reduce-scatter starts when u2's backward ends (34); u1's all-gather has 8 ms left: both
    # at half speed until it ends at 50; the reduce-scatter's last 2 ms alone: 52.
    assert at(shared, Activity.REDUCE_SCATTER, 2) == (34, 52)
    assert at(shared, Activity.BACKWARD_ALL_GATHER, 1) == (32, 50)
    assert at(shared, Activity.BACKWARD, 1) == (50, 52)
    assert shared.iteration_ms == 62  # ideal sharing loses nothing
    lossy = simulate_iteration(small(FSDP), LinkModel(one_collective_per_group=False, contention=2))
    # Shared, each at a quarter: the all-gather's 8 ms end at 66, the reduce-scatter's 2 left at 68.
    assert at(lossy, Activity.BACKWARD_ALL_GATHER, 1) == (32, 66)
    assert at(lossy, Activity.REDUCE_SCATTER, 2) == (34, 68)
    assert lossy.iteration_ms == 78


def test_hsdp_async_cross_link_slowdown_by_hand() -> None:
    t = simulate_iteration(small(HSDP_ASYNC), LinkModel(cross_link_slowdown=2))
    # u2's reduce-scatter (14-17) ends before any all-reduce starts: as without the slowdown.
    assert at(t, Activity.REDUCE_SCATTER, 2) == (14, 17) and at(t, Activity.ALL_REDUCE, 2) == (17, 37)
    # u1's reduce-scatter runs beside u2's all-reduce: its 3 ms at half speed.
    assert at(t, Activity.REDUCE_SCATTER, 1) == (17, 23)
    # The all-reduces are not slowed, and u1's still waits for u2's on its stream.
    assert at(t, Activity.ALL_REDUCE, 1) == (37, 57) and t.iteration_ms == 57


def test_hsdp_async_compute_slowdown_by_hand() -> None:
    intra = LinkModel(compute_slowdown=ComputeSlowdown(all_gather_intra=2, reduce_scatter_intra=2))
    t = simulate_iteration(small(HSDP_ASYNC), intra)
    # Forward: every all-gather runs while no compute does.
    assert at(t, Activity.FORWARD_ALL_GATHER, 2) == (4, 7) and at(t, Activity.BACKWARD_ALL_GATHER, 2) == (8, 11)
    # u1's prefetch beside u2's backward (11-13) at half speed (1 ms of work), then 2 ms alone: 15.
    assert at(t, Activity.BACKWARD, 2) == (11, 13) and at(t, Activity.BACKWARD_ALL_GATHER, 1) == (11, 15)
    # u2's reduce-scatter after it on the shard group, beside u1's backward (15-17) at half speed
    # (1 ms), then 2 ms alone: 19. The all-reduces are inter-node: not slowed.
    assert at(t, Activity.BACKWARD, 1) == (15, 17) and at(t, Activity.REDUCE_SCATTER, 2) == (15, 19)
    assert at(t, Activity.ALL_REDUCE, 2) == (19, 39) and at(t, Activity.REDUCE_SCATTER, 1) == (19, 22)
    assert at(t, Activity.ALL_REDUCE, 1) == (39, 59) and t.iteration_ms == 59
    # Inter-node collectives only (FSDP): the intra-node factors change nothing.
    assert simulate_iteration(small(FSDP), intra) == dataclasses.replace(simulate_iteration(small(FSDP)), links=intra)
    # Each collective by its own factor: only the all-reduce (inter-node, never beside compute
    # here) slowed: nothing moves.
    reduce = LinkModel(compute_slowdown=ComputeSlowdown(all_reduce_inter=3))
    assert simulate_iteration(small(HSDP_ASYNC), reduce).iteration_ms == 57


def test_fsdp_compute_slowdown_by_hand() -> None:
    t = simulate_iteration(small(FSDP), LinkModel(compute_slowdown=ComputeSlowdown(all_gather_inter=2)))
    # u1's backward all-gather (32-42 unslowed) runs beside u2's backward (32-34) at half speed:
    # 1 ms of work, the other 9 alone: 32-43. Reduce-scatters are not slowed.
    assert at(t, Activity.BACKWARD_ALL_GATHER, 1) == (32, 43)
    assert at(t, Activity.REDUCE_SCATTER, 2) == (43, 53) and at(t, Activity.BACKWARD, 1) == (43, 45)
    assert at(t, Activity.REDUCE_SCATTER, 1) == (53, 63) and t.iteration_ms == 63


def test_fsdp_transfers_slow_compute_by_hand() -> None:
    t = simulate_iteration(small(FSDP), LinkModel(transfers_slow_compute=2))
    # u2's backward (2 ms) beside u1's prefetched all-gather (32-42): at half speed, 32-36; u1's
    # beside u2's reduce-scatter (42-52): 42-46. The collectives are not slowed, and the
    # reduce-scatters still end the iteration: 62, as without.
    assert at(t, Activity.BACKWARD, 2) == (32, 36) and at(t, Activity.BACKWARD_ALL_GATHER, 1) == (32, 42)
    assert at(t, Activity.BACKWARD, 1) == (42, 46) and at(t, Activity.REDUCE_SCATTER, 1) == (52, 62)
    assert t.iteration_ms == 62
    # The forward's compute runs after its all-gather: not slowed.
    assert at(t, Activity.FORWARD, 1) == (10, 11) and at(t, Activity.FORWARD, 2) == (21, 22)


def test_backward_pre_prefetch_overlaps_the_next_all_gather_with_backward() -> None:
    pre = simulate_iteration(small(FSDP))
    assert pre.find(Activity.BACKWARD_ALL_GATHER, 1).start_ms < pre.find(Activity.BACKWARD, 2).end_ms
    none = simulate_iteration(small(FSDP, backward_prefetch=None))
    # Each unit gathers in its own pre-backward: u1's all-gather is issued when u2's backward
    # ends (34) and queues behind u2's reduce-scatter on the shard group.
    assert at(none, Activity.BACKWARD_ALL_GATHER, 2) == (22, 32)
    assert at(none, Activity.REDUCE_SCATTER, 2) == (34, 44)
    assert at(none, Activity.BACKWARD_ALL_GATHER, 1) == (44, 54)
    assert none.iteration_ms == 66 > pre.iteration_ms


def test_backward_post_prefetches_before_the_reduce_scatter_as_fsdp1() -> None:
    post = simulate_iteration(small(FSDP, backward_prefetch=BackwardPrefetch.BACKWARD_POST))
    assert at(post, Activity.BACKWARD_ALL_GATHER, 1) == (34, 44)
    assert at(post, Activity.REDUCE_SCATTER, 2) == (44, 54)
    assert post.iteration_ms == 64


def test_forward_prefetch_issues_the_next_all_gather_before_the_forward() -> None:
    t = simulate_iteration(small(FSDP, forward_prefetch=True))
    assert at(t, Activity.FORWARD_ALL_GATHER, 2) == (10, 20)
    assert at(t, Activity.FORWARD, 1) == (10, 11) and at(t, Activity.FORWARD, 2) == (20, 21)


def test_streams_run_one_task_at_a_time_and_the_timeline_is_deterministic() -> None:
    for row in SEED_ROWS:
        t = simulate_iteration(seed_model(row=row))
        assert t == simulate_iteration(seed_model(row=row)) and hash(t) == hash(simulate_iteration(seed_model(row=row)))
        for stream in Stream:
            mine = t.on(stream)
            assert all(a.end_ms <= b.start_ms for a, b in itertools.pairwise(mine))
        assert t.iteration_ms == max(i.end_ms for i in t.intervals)


@pytest.mark.parametrize(
    ("build", "error", "fragment"),
    [
        (
            lambda: CollectiveCosts(
                all_gather_intra_ms=-1,
                all_gather_inter_ms=0,
                reduce_scatter_intra_ms=0,
                reduce_scatter_inter_ms=0,
                all_reduce_inter_ms=0,
            ),
            ValueError,
            "all_gather_intra_ms",
        ),
        (
            lambda: UnitCosts(name="u", forward_ms=float("nan"), backward_ms=0, collectives=NOTHING),
            ValueError,
            "forward_ms",
        ),
        (lambda: UnitCosts(name="", forward_ms=0, backward_ms=0, collectives=NOTHING), ValueError, "name"),
        (lambda: IterationModel(units=(), plans=()), TypeError, "units"),
        (
            lambda: IterationModel(units=(small().units[1], small().units[1]), plans=plans_of(FSDP, 2)),
            ValueError,
            "unique",
        ),
        (lambda: LinkModel(contention=0.5), ValueError, "contention"),
        (lambda: LinkModel(inter_node_bandwidth=0), ValueError, "inter_node_bandwidth"),
        (lambda: LinkModel(intra_node_bandwidth=float("inf")), ValueError, "intra_node_bandwidth"),
        (lambda: LinkModel(cross_link_slowdown=0.9), ValueError, "cross_link_slowdown"),
        (lambda: LinkModel(transfers_slow_compute=0.5), ValueError, "transfers_slow_compute"),
        (lambda: ComputeSlowdown(all_gather_intra=float("nan")), ValueError, "all_gather_intra"),
        (lambda: ComputeSlowdown(all_reduce_inter=True), ValueError, "all_reduce_inter"),
        (lambda: ComputeSlowdown(reduce_scatter_inter=0.5), ValueError, "reduce_scatter_inter"),
        (lambda: LinkModel(compute_slowdown=2.0), TypeError, "compute_slowdown"),  # type: ignore[arg-type]
        (lambda: ComputeSlowdown().of(Activity.FORWARD, INTRA), ValueError, "collective"),
        (lambda: IterationModel(units=small().units, plans=plans_of(FSDP, 2)), ValueError, "one per unit"),
        (
            lambda: IterationModel(units=small().units[:2], plans=(*plans_of(FSDP, 1), *plans_of(HSDP_SYNC, 1))),
            ValueError,
            "same sharding",
        ),
        (lambda: IterationModel(units=small().units, plans=plans_of(FSDP), ranks_per_node=0), ValueError, "ranks"),
        (
            lambda: IterationModel(units=small().units, plans=plans_of(FSDP), gathered_at_start=frozenset({3})),
            ValueError,
            "gathered_at_start",
        ),
    ],
)
def test_bad_inputs_fail_at_construction(build: object, error: type[Exception], fragment: str) -> None:
    assert callable(build)
    with pytest.raises(error, match=fragment):
        build()


def test_the_plans_decide_the_streams_and_the_ranks_per_node_the_links() -> None:
    """Nothing re-decides what the planner decided: the all-reduce's stream is the plan's; a
    shard group that fits in a node uses the intra-node link, one that spans nodes the other."""
    sync, asynchronous = (simulate_iteration(small(kind)) for kind in (HSDP_SYNC, HSDP_ASYNC))
    assert {i.stream for i in sync.intervals if i.activity is Activity.ALL_REDUCE} == {Stream.POST_BACKWARD}
    assert {i.stream for i in asynchronous.intervals if i.activity is Activity.ALL_REDUCE} == {Stream.ALL_REDUCE}
    one_node = simulate_iteration(dataclasses.replace(small(FSDP), ranks_per_node=16))
    assert {i.link for i in one_node.intervals if i.activity.is_collective} == {INTRA}
    assert sync.label == "HYBRID_SHARD 2 x 8, sync all-reduce" and one_node.label == "FULL_SHARD over 16"


def test_collective_work_beside_compute_by_hand() -> None:
    """Async HSDP of the small model (timeline above): of the collectives, only u1's backward
    all-gather (11-14 ms, beside u2's backward 11-13) and u2's reduce-scatter (14-17, beside u1's
    backward 14-16) overlap compute, each for 2 of its 3 ms; the all-reduces run while nothing
    computes. So 3 ms of work per collective of u2 puts 2 ms beside compute, 1 ms per
    collective 4/3 ms, and work on the all-reduces alone none."""
    t = simulate_iteration(small(HSDP_ASYNC))
    assert t.work_beside_compute_ms(lambda i: 3.0 if i.unit == 2 else 0.0) == 2
    assert t.work_beside_compute_ms(lambda i: 1.0) == pytest.approx(4 / 3)
    assert t.work_beside_compute_ms(lambda i: 5.0 if i.activity is Activity.ALL_REDUCE else 0.0) == 0


def test_exposed_communication_and_the_limiting_link_by_hand() -> None:
    """Async HSDP of the small model (timeline above): compute runs 3-4, 7-8, 11-13 and 14-16 ms.
    u2's collectives (all-gathers 4-7 and 8-11, reduce-scatter 14-17, all-reduce 17-37) are
    hidden only where compute runs: 3 + 3 + 1 + 20 = 27 ms exposed. The iteration ends with u1's
    all-reduce, after u2's on the all-reduce stream, after u2's reduce-scatter (intra-node):
    the inter-node link limits it."""
    t = simulate_iteration(small(HSDP_ASYNC))
    assert t.exposed_ms(2) == 27
    assert t.exposed_ms(0) == 0
    assert t.limiting_link is INTER
    critical = [t.intervals[k] for k in t.critical if t.intervals[k].duration_ms > 0]  # the root's cost nothing
    assert [(i.unit, i.activity) for i in critical[:3]] == [
        (1, Activity.ALL_REDUCE),
        (2, Activity.ALL_REDUCE),
        (2, Activity.REDUCE_SCATTER),
    ]
    assert simulate_iteration(small(FSDP)).limiting_link is INTER
