"""The whole-iteration simulator: the link model, stream order, prefetch, the seed's table,
calibration from measurements, and the renderings. Expected times are worked out by hand."""

from __future__ import annotations

import dataclasses
import itertools
import json
from fractions import Fraction

import pytest
import torch

from fsdp_core import (
    BackwardPrefetch,
    Event,
    FlatParamLayout,
    HookEvent,
    HybridAllReduce,
    MixedPrecision,
    Plan,
    PlanRequest,
    ShardingSpec,
    ShardingStrategy,
    Stream,
    UnshardRequest,
    comm_volume,
    plan_post_backward,
)
from fsdp_core.memory import ActivationTrace, Executor, UnitSpec
from fsdp_core.sim import (
    ACTIVITY_MARKS,
    SEED_PARAMETERS,
    SEED_ROWS,
    Activity,
    Collective,
    CollectiveCosts,
    CollectiveSample,
    ComputeSlowdown,
    CostModel,
    IterationModel,
    IterationTimeline,
    Link,
    LinkModel,
    Load,
    MeasuredUnit,
    Measurements,
    SeedParameters,
    SharingSample,
    SimTask,
    SlowdownSample,
    UnitCosts,
    compute_slowdown_of,
    describe_cost,
    fit_affine,
    fit_collectives,
    fit_seed,
    fit_table,
    flops_compute_ms,
    format_iteration,
    format_seed_table,
    iteration_to_trace,
    links_from_measurements,
    model_from_measurements,
    model_of_units,
    run_tasks,
    seed_calibration,
    seed_model,
    simulate_iteration,
    simulate_timeline,
    slowdown,
    unit_plans,
)

F = Fraction
INTER, INTRA = Link.INTER_NODE, Link.INTRA_NODE
ONE = {INTER: F(1), INTRA: F(1)}


# -- the link model ---------------------------------------------------------------------------


def spans(*pairs: tuple[int, int]) -> tuple[tuple[Fraction, Fraction], ...]:
    """Exact (start, end) pairs, as ``run_tasks`` returns them."""
    return tuple((F(a), F(b)) for a, b in pairs)


def transfer(work: int, link: Link = INTER, after: tuple[int, ...] = (), beside_compute: int = 1) -> SimTask:
    return SimTask(after=after, work=F(work), link=link, compute_slowdown=F(beside_compute))


def test_a_lone_transfer_takes_its_cost() -> None:
    assert run_tasks([transfer(7)], capacity=ONE) == spans((0, 7))


def test_two_equal_transfers_sharing_a_link_take_twice_as_long() -> None:
    assert run_tasks([transfer(10), transfer(10)], capacity=ONE) == spans((0, 20), (0, 20))


def test_contention_slows_shared_transfers_beyond_the_split() -> None:
    # Each at 1 / (2 * 1.5) of the link: 10 ms of work take 30 ms.
    assert run_tasks([transfer(10), transfer(10)], capacity=ONE, contention=F(3, 2)) == spans((0, 30), (0, 30))
    # Contention costs nothing to a transfer alone.
    assert run_tasks([transfer(10)], capacity=ONE, contention=F(3)) == spans((0, 10))


def test_unequal_transfers_share_until_the_shorter_ends() -> None:
    # Both at half speed until 4 ms of work are done at t=8; the rest (6 ms) alone: 14.
    assert run_tasks([transfer(10), transfer(4)], capacity=ONE) == spans((0, 14), (0, 8))


def test_a_transfer_joining_later_shares_only_from_then_on() -> None:
    # A alone for 4 ms (6 left); then A and B at half speed: B's 4 ms end at 12, A has 2 left: 14.
    tasks = [transfer(10), SimTask(after=(), work=F(4)), transfer(4, after=(1,))]
    assert run_tasks(tasks, capacity=ONE) == spans((0, 14), (0, 4), (4, 12))


def test_different_links_and_compute_do_not_share() -> None:
    tasks = [transfer(10, INTER), transfer(10, INTRA), SimTask(after=(), work=F(10)), SimTask(after=(), work=F(10))]
    assert run_tasks(tasks, capacity=ONE) == spans((0, 10)) * 4


def test_capacity_scales_a_link() -> None:
    assert run_tasks([transfer(10)], capacity={INTER: F(2)}) == spans((0, 5))


def test_dependencies_and_zero_work() -> None:
    tasks = [SimTask(after=(), work=F(3)), SimTask(after=(0,), work=F(0)), transfer(2, after=(1,))]
    assert run_tasks(tasks, capacity=ONE) == spans((0, 3), (3, 3), (3, 5))


def test_an_inter_node_transfer_slows_intra_node_ones_and_not_the_reverse() -> None:
    # The intra-node transfer at half speed while the inter-node one runs (0-10: 5 ms of its
    # work), then alone (5 more): 15. The inter-node one is not slowed: 10.
    tasks = [transfer(10, INTRA), transfer(10, INTER)]
    assert run_tasks(tasks, capacity=ONE, cross_link_slowdown=F(2)) == spans((0, 15), (0, 10))
    # Transfers on one link only: no slowdown across links, only sharing.
    assert run_tasks([transfer(10, INTRA), transfer(10, INTRA)], capacity=ONE, cross_link_slowdown=F(3)) == spans(
        (0, 20), (0, 20)
    )
    # Compute on its own is no other link.
    tasks = [transfer(10, INTRA), SimTask(after=(), work=F(10))]
    assert run_tasks(tasks, capacity=ONE, cross_link_slowdown=F(2)) == spans((0, 10), (0, 10))


def test_compute_slows_each_transfer_by_its_own_factor() -> None:
    # 0-4 beside compute at half speed (2 ms of work), the other 8 alone: 12. A transfer with
    # factor 1 is not slowed; compute never is.
    tasks = [SimTask(after=(), work=F(4)), transfer(10, INTRA, beside_compute=2), transfer(10, INTER)]
    assert run_tasks(tasks, capacity=ONE) == spans((0, 4), (0, 12), (0, 10))
    # Two transfers on one link, different factors: each slowed by its own.
    tasks = [SimTask(after=(), work=F(4)), transfer(4, beside_compute=2), transfer(4, beside_compute=4)]
    # 0-4: at 1/(2*2) and 1/(2*4): 1 and 1/2 ms of work; then both at 1/2: the first's 3 ms at
    # 10, the second has 1/2 left, alone: 10.5.
    assert run_tasks(tasks, capacity=ONE) == ((F(0), F(4)), (F(0), F(10)), (F(0), F(21, 2)))


def test_transfers_slow_compute_while_any_is_active() -> None:
    # 0-4 beside the transfer at half speed (2 ms of its work), its other 4 alone: 8. The
    # transfer is not slowed (its own factor is 1).
    tasks = [SimTask(after=(), work=F(6)), transfer(4, INTRA)]
    assert run_tasks(tasks, capacity=ONE, transfers_slow_compute=F(2)) == spans((0, 8), (0, 4))
    # Both ways at half speed (one processor shared): the transfer's 4 ms take 8, in which the
    # compute does 4 of its 6; its last 2 alone: 10, the sum of the two.
    tasks = [SimTask(after=(), work=F(6)), transfer(4, INTRA, beside_compute=2)]
    assert run_tasks(tasks, capacity=ONE, transfers_slow_compute=F(2)) == spans((0, 10), (0, 8))
    # Nothing slows compute that runs alone.
    assert run_tasks([SimTask(after=(), work=F(6))], capacity=ONE, transfers_slow_compute=F(5)) == spans((0, 6))
    with pytest.raises(ValueError, match="transfers_slow_compute"):
        run_tasks(tasks, capacity=ONE, transfers_slow_compute=F(1, 2))


def test_slowdowns_multiply() -> None:
    # Intra-node: 0-6 beside compute and the inter-node transfer at 1/(3*2) (1 ms of work); 6-20
    # beside the inter-node one at 1/2 (7 ms); its last 4 ms alone: 24.
    tasks = [SimTask(after=(), work=F(6)), transfer(12, INTRA, beside_compute=3), transfer(20, INTER)]
    times = run_tasks(tasks, capacity=ONE, cross_link_slowdown=F(2))
    assert times == spans((0, 6), (0, 24), (0, 20))
    # Sharing too: two intra-node transfers beside the inter-node one, each at 1/(2*2*2) with
    # contention 2 until it ends at 8 (1 ms of work each), then at 1/(2*2): 3 ms more take 12.
    tasks = [transfer(4, INTRA), transfer(4, INTRA), transfer(8, INTER)]
    times = run_tasks(tasks, capacity=ONE, contention=F(2), cross_link_slowdown=F(2))
    assert times == spans((0, 20), (0, 20), (0, 8))


def test_speedups_are_rejected() -> None:
    with pytest.raises(ValueError, match="cross_link_slowdown"):
        run_tasks([transfer(1)], capacity=ONE, cross_link_slowdown=F(1, 2))
    with pytest.raises(ValueError, match="compute_slowdown"):
        SimTask(after=(), work=F(1), link=INTRA, compute_slowdown=F(9, 10))
    with pytest.raises(ValueError, match="compute_slowdown"):
        SimTask(after=(), work=F(1), compute_slowdown=F(2))  # compute is never slowed


@pytest.mark.parametrize(
    ("tasks", "capacity", "contention", "fragment"),
    [
        ([SimTask(after=(0,), work=F(1))], ONE, F(1), r"tasks\[0\]\.after"),
        ([transfer(1)], {INTRA: F(1)}, F(1), "capacity"),
        ([transfer(1)], ONE, F(1, 2), "contention"),
    ],
)
def test_run_tasks_rejects_bad_input(
    tasks: list[SimTask], capacity: dict[Link, Fraction], contention: Fraction, fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        run_tasks(tasks, capacity=capacity, contention=contention)


# -- one iteration of a small model -------------------------------------------------------------

COSTS = CollectiveCosts(
    all_gather_intra_ms=3,
    all_gather_inter_ms=10,
    reduce_scatter_intra_ms=3,
    reduce_scatter_inter_ms=10,
    all_reduce_inter_ms=20,
)
NOTHING = CollectiveCosts(
    all_gather_intra_ms=0,
    all_gather_inter_ms=0,
    reduce_scatter_intra_ms=0,
    reduce_scatter_inter_ms=0,
    all_reduce_inter_ms=0,
)


FSDP, HSDP_SYNC, HSDP_ASYNC = "fsdp", "hsdp_sync", "hsdp_async"
"""Three ways to run the small model on 2 nodes of 8 ranks: ``FULL_SHARD`` over all 16, or
``HYBRID_SHARD`` with a shard group per node and the all-reduce sync or async."""


def plans_of(kind: str, units: int = 3) -> tuple[Plan, ...]:
    if kind == FSDP:
        return unit_plans(units, ShardingStrategy.FULL_SHARD, 16)
    placement = HybridAllReduce.SYNC if kind == HSDP_SYNC else HybridAllReduce.ASYNC
    return unit_plans(units, ShardingStrategy.HYBRID_SHARD, 16, 8, hybrid_all_reduce=placement)


def small(
    kind: str = HSDP_ASYNC,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = False,
) -> IterationModel:
    """A root without cost wrapping two units of forward 1 ms, backward 2 ms, run as ``kind``."""
    root = UnitCosts(name="root", forward_ms=0, backward_ms=0, collectives=NOTHING)
    units = tuple(UnitCosts(name=f"u{i}", forward_ms=1, backward_ms=2, collectives=COSTS) for i in (1, 2))
    return IterationModel(
        units=(root, *units),
        plans=plans_of(kind),
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
    )


def at(timeline: IterationTimeline, activity: Activity, unit: int) -> tuple[float, float]:
    i = timeline.find(activity, unit)
    return (i.start_ms, i.end_ms)


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


# -- the seed's table -------------------------------------------------------------------------


def test_all_four_seed_numbers_within_ten_percent_in_the_seed_order() -> None:
    results = seed_calibration().results
    assert [r.row.key for r in results] == ["fsdp", "hsdp_sync", "hsdp_async", "hsdp_async_cross_nic"]
    for r in results:
        assert abs(r.ratio - 1) <= 0.10, (r.row.key, r.simulated_ms, r.row.seed_ms)
    times = [r.simulated_ms for r in results]
    assert times[0] > times[1] > times[2] > times[3]


def test_two_parameters_are_fitted_to_two_numbers_and_reproduce_them() -> None:
    fitted = {r.row.key: r.row.fitted for r in seed_calibration().results}
    assert fitted == {
        "fsdp": None,
        "hsdp_sync": None,
        "hsdp_async": "encoder_forward_ms",
        "hsdp_async_cross_nic": "cross_nic_bandwidth_factor",
    }
    for r in seed_calibration().results:
        if r.row.fitted is not None:
            assert r.ratio == pytest.approx(1, abs=2e-4)


def test_the_fitted_parameters_are_what_the_code_says() -> None:
    fit = fit_seed()
    assert round(fit.encoder_forward_ms, 4) == SEED_PARAMETERS.encoder_forward_ms == 1.4563
    assert round(fit.cross_nic_bandwidth_factor, 4) == SEED_PARAMETERS.cross_nic_bandwidth_factor == 1.0874
    # The others are a priori, not fitted.
    a_priori = SeedParameters(encoder_forward_ms=0, cross_nic_bandwidth_factor=1)
    for name in ("backward_per_forward", "decoder_per_encoder_compute", "contention"):
        assert getattr(fit, name) == getattr(SEED_PARAMETERS, name) == getattr(a_priori, name)
    assert (SEED_PARAMETERS.backward_per_forward, SEED_PARAMETERS.contention) == (2.0, 1.0)
    assert SEED_PARAMETERS.decoder_per_encoder_compute == 40 / 23


def test_no_two_collectives_share_a_link_in_the_seed_rows_so_contention_has_no_effect() -> None:
    base = seed_calibration()
    for r in base.results:
        for link in Link:
            busy = sorted((i.start_ms, i.end_ms) for i in r.timeline.intervals if i.link is link and i.duration_ms > 0)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(busy))
    lossy = seed_calibration(dataclasses.replace(SEED_PARAMETERS, contention=3.0))
    assert [r.simulated_ms for r in lossy.results] == [r.simulated_ms for r in base.results]


def test_seed_model_shape() -> None:
    model = seed_model()
    assert [u.name for u in model.units] == ["root", *(f"enc{i}" for i in range(6)), *(f"dec{i}" for i in range(6))]
    enc, dec = model.units[1], model.units[7]
    assert enc.forward_ms == SEED_PARAMETERS.encoder_forward_ms and enc.backward_ms == 2 * enc.forward_ms
    assert dec.forward_ms == pytest.approx(enc.forward_ms * 40 / 23)
    assert enc.collectives is not None and dec.collectives is not None
    assert (enc.collectives.all_gather_inter_ms, dec.collectives.all_reduce_inter_ms) == (23, 55)
    assert model.backward_prefetch is BackwardPrefetch.BACKWARD_PRE and not model.forward_prefetch
    assert len(SEED_ROWS) == 4


def test_seed_table_text() -> None:
    text = format_seed_table(seed_calibration())
    assert "FSDP (FULL_SHARD, 32 GPUs)    1160" in text
    assert text.count("predicted") == 2 and "fitted: encoder_forward_ms" in text
    assert "no two collectives share a link" in text and "refitted" not in text
    other = format_seed_table(seed_calibration(one_collective_per_group=False))
    assert "one_collective_per_group=False" in other and "nothing refitted" in other


# -- calibration from measurements --------------------------------------------------------------


def sample(collective: Collective, link: Link, nbytes: int, ms: float) -> CollectiveSample:
    return CollectiveSample(collective=collective, link=link, nbytes=nbytes, ms=ms)


def test_fit_affine_recovers_latency_and_bandwidth() -> None:
    # 0.5 ms + 1 ms per 50 kB (400 Mbit/s).
    points = [sample(Collective.ALL_GATHER, INTER, n, 0.5 + n / 50_000) for n in (100_000, 1_000_000, 4_000_000)]
    fit = fit_affine(points)
    assert fit.latency_ms == pytest.approx(0.5) and fit.ms_per_byte == pytest.approx(1 / 50_000)
    assert fit.ms(0) == 0 and fit.ms(2_000_000) == pytest.approx(40.5)
    assert fit_affine(list(reversed(points))) == fit


def test_fit_affine_one_size_and_negative_latency_go_through_the_origin() -> None:
    one = fit_affine([sample(Collective.ALL_REDUCE, INTER, 1000, 2.0), sample(Collective.ALL_REDUCE, INTER, 1000, 4.0)])
    assert (one.latency_ms, one.ms_per_byte) == (0.0, 3.0 / 1000)
    negative = fit_affine(
        [sample(Collective.ALL_REDUCE, INTER, 1000, 1.0), sample(Collective.ALL_REDUCE, INTER, 2000, 3.0)]
    )
    assert negative.latency_ms == 0.0 and negative.ms_per_byte == pytest.approx(7.0 / 5000)
    flat = fit_affine(
        [sample(Collective.ALL_REDUCE, INTER, 1000, 3.0), sample(Collective.ALL_REDUCE, INTER, 2000, 1.0)]
    )
    assert (flat.latency_ms, flat.ms_per_byte) == (2.0, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        fit_affine([])


def test_fit_collectives_names_what_is_missing() -> None:
    with pytest.raises(
        ValueError, match="reduce_scatter on intra_node, reduce_scatter on inter_node, all_reduce on inter_node"
    ):
        fit_collectives([sample(Collective.ALL_GATHER, INTRA, 10, 1.0), sample(Collective.ALL_GATHER, INTER, 10, 1.0)])


def emulated_cluster() -> Measurements:
    """Synthetic numbers shaped like the later benchmark: 2 nodes x 2 ranks, 400 Mbit/s between."""
    samples = []
    for n in (1_000_000, 4_000_000):
        samples += [
            sample(Collective.ALL_GATHER, INTRA, n, 0.1 + n / 2e6),
            sample(Collective.REDUCE_SCATTER, INTRA, n, 0.2 + n / 2e6),
            sample(Collective.ALL_GATHER, INTER, n, 1.0 + n / 5e4),
            sample(Collective.REDUCE_SCATTER, INTER, n, 1.5 + n / 5e4),
            sample(Collective.ALL_REDUCE, INTER, n // 2, 2.0 + n / 5e4),
            sample(Collective.ALL_REDUCE, INTRA, n, 99.0),  # not needed: ignored
        ]
    units = (
        MeasuredUnit(name="root", param_bytes=2_000_001, forward_ms=3.0, backward_ms=6.0),
        *(MeasuredUnit(name=f"layer{i}", param_bytes=4_000_000, forward_ms=5.0, backward_ms=10.0) for i in range(2)),
    )
    return Measurements(units=units, samples=tuple(samples), ranks_per_node=2)


def cluster_plans(kind: str) -> tuple[Plan, ...]:
    """The three units' plans on 2 nodes of 2 ranks."""
    if kind == FSDP:
        return unit_plans(3, ShardingStrategy.FULL_SHARD, 4)
    placement = HybridAllReduce.SYNC if kind == HSDP_SYNC else HybridAllReduce.ASYNC
    return unit_plans(3, ShardingStrategy.HYBRID_SHARD, 4, 2, hybrid_all_reduce=placement)


def test_model_from_measurements_prices_each_unit_at_its_size() -> None:
    model = model_from_measurements(emulated_cluster(), cluster_plans(HSDP_ASYNC))
    root, layer = model.units[0], model.units[1]
    assert (layer.forward_ms, layer.backward_ms) == (5.0, 10.0)
    c = layer.collectives
    assert c is not None and root.collectives is not None
    assert c.all_gather_intra_ms == pytest.approx(0.1 + 2.0)
    assert c.reduce_scatter_intra_ms == pytest.approx(0.2 + 2.0)
    assert c.all_gather_inter_ms == pytest.approx(1.0 + 80.0)
    assert c.reduce_scatter_inter_ms == pytest.approx(1.5 + 80.0)
    # The all-reduce reduces one shard: 4e6 / 2 ranks per node = 2e6 bytes, at 1 ms per 25 kB.
    assert c.all_reduce_inter_ms == pytest.approx(2.0 + 80.0)
    # ceil(2_000_001 / 2) = 1_000_001 bytes.
    assert root.collectives.all_reduce_inter_ms == pytest.approx(2.0 + 1_000_001 / 2.5e4)
    hand = IterationModel(
        units=tuple(
            UnitCosts(name=u.name, forward_ms=u.forward_ms, backward_ms=u.backward_ms, collectives=u.collectives)
            for u in model.units
        ),
        plans=model.plans,
        ranks_per_node=2,
    )
    assert simulate_iteration(model) == simulate_iteration(hand)
    # On a 400 Mbit/s link the replicate all-reduces dominate: async overlaps them with backward.
    times = {
        kind: simulate_iteration(model_from_measurements(emulated_cluster(), cluster_plans(kind))).iteration_ms
        for kind in (FSDP, HSDP_SYNC, HSDP_ASYNC)
    }
    assert times[HSDP_SYNC] > times[HSDP_ASYNC]


def test_measurements_validate() -> None:
    with pytest.raises(ValueError, match="ranks_per_node"):
        Measurements(units=emulated_cluster().units, samples=(), ranks_per_node=0)
    with pytest.raises(ValueError, match="nbytes"):
        sample(Collective.ALL_GATHER, INTER, 0, 1.0)
    with pytest.raises(ValueError, match="param_bytes"):
        MeasuredUnit(name="u", param_bytes=-1, forward_ms=0, backward_ms=0)


def slowed(load: Load, collective: Collective, link: Link, alone: float, loaded: float) -> SlowdownSample:
    return SlowdownSample(load=load, collective=collective, link=link, alone_ms=alone, loaded_ms=loaded)


def test_links_from_measurements_by_hand() -> None:
    base = emulated_cluster()
    # Nothing timed under load: the default link model.
    assert links_from_measurements(base) == LinkModel()
    slowdowns = (
        # Across links, intra-node: (3 + 5) / (2 + 4) = 4/3.
        slowed(Load.OTHER_LINK, Collective.ALL_GATHER, INTRA, 2.0, 3.0),
        slowed(Load.OTHER_LINK, Collective.REDUCE_SCATTER, INTRA, 4.0, 5.0),
        # The all-reduce beside intra-node traffic: recorded, not used (the model is one-sided).
        slowed(Load.OTHER_LINK, Collective.ALL_REDUCE, INTER, 20.0, 40.0),
        # Beside compute, per collective: 8 / 2 = 4; (10 + 14) / (4 + 4) = 3 (two samples);
        # 30 / 20 = 1.5; 5 / 10 is faster: 1. The inter-node reduce-scatter, not timed: 1.
        slowed(Load.COMPUTE, Collective.ALL_GATHER, INTRA, 2.0, 8.0),
        slowed(Load.COMPUTE, Collective.REDUCE_SCATTER, INTRA, 4.0, 10.0),
        slowed(Load.COMPUTE, Collective.REDUCE_SCATTER, INTRA, 4.0, 14.0),
        slowed(Load.COMPUTE, Collective.ALL_REDUCE, INTER, 20.0, 30.0),
        slowed(Load.COMPUTE, Collective.ALL_GATHER, INTER, 10.0, 5.0),
    )
    # Sharing: 10 and 14 ms alone, 30 together: 2 * 10 * c + 4 = 30, c = 1.3. With a second pair
    # (2 and 2 alone, 3 together: faster than in turn) from the sums: (26 + 3) / (20 + 4).
    one = SharingSample(link=INTER, first_ms=10.0, second_ms=14.0, together_ms=30.0)
    two = SharingSample(link=INTRA, first_ms=2.0, second_ms=2.0, together_ms=3.0)
    links = links_from_measurements(dataclasses.replace(base, slowdowns=slowdowns, sharing=(one,)))
    assert links.cross_link_slowdown == pytest.approx(4 / 3)
    assert links.compute_slowdown == ComputeSlowdown(
        all_gather_intra=4.0, reduce_scatter_intra=3.0, all_reduce_inter=1.5
    )
    assert links.contention == pytest.approx(1.3) and links.one_collective_per_group
    assert (links.inter_node_bandwidth, links.intra_node_bandwidth) == (1.0, 1.0)
    both = links_from_measurements(dataclasses.replace(base, sharing=(one, two)), one_collective_per_group=False)
    assert both.contention == pytest.approx(29 / 24) and not both.one_collective_per_group
    # A load that speeds a collective up, or sharing faster than taking turns, gives 1, not less.
    faster = (slowed(Load.COMPUTE, Collective.ALL_REDUCE, INTER, 20.0, 18.0),)
    assert links_from_measurements(dataclasses.replace(base, slowdowns=faster, sharing=(two,))) == LinkModel()


def test_compute_slowdown_of_one_node_by_hand() -> None:
    samples = (
        # All-gathers on both links: (8 + 6) / (2 + 5) = 2 for both links when they are one node.
        slowed(Load.COMPUTE, Collective.ALL_GATHER, INTRA, 2.0, 8.0),
        slowed(Load.COMPUTE, Collective.ALL_GATHER, INTER, 5.0, 6.0),
        # An all-reduce timed inside a node counts for the all-reduce (inter-node only otherwise).
        slowed(Load.COMPUTE, Collective.ALL_REDUCE, INTRA, 4.0, 10.0),
        # Another load is ignored.
        slowed(Load.OTHER_LINK, Collective.REDUCE_SCATTER, INTRA, 1.0, 9.0),
    )
    assert compute_slowdown_of(samples, one_node=True) == ComputeSlowdown(
        all_gather_intra=2.0, all_gather_inter=2.0, all_reduce_inter=2.5
    )
    # Per link: 8 / 2 and 6 / 5; the all-reduce's only sample is on the other link: 1.
    assert compute_slowdown_of(samples) == ComputeSlowdown(all_gather_intra=4.0, all_gather_inter=1.2)
    assert compute_slowdown_of(()) == ComputeSlowdown()


def test_slowdown_is_the_ratio_of_sums_at_least_one() -> None:
    assert slowdown([1.0, 3.0], [2.0, 4.0]) == 1.5
    assert slowdown([2.0], [1.0]) == 1.0
    assert slowdown([], []) == 1.0
    assert slowdown([0.0], [5.0]) == 1.0


def test_slowdown_and_sharing_samples_validate() -> None:
    with pytest.raises(ValueError, match="loaded_ms"):
        slowed(Load.COMPUTE, Collective.ALL_GATHER, INTRA, 1.0, -1.0)
    with pytest.raises(TypeError, match="load"):
        SlowdownSample(
            load="compute",  # type: ignore[arg-type]
            collective=Collective.ALL_GATHER,
            link=INTRA,
            alone_ms=1.0,
            loaded_ms=1.0,
        )
    with pytest.raises(ValueError, match="together_ms"):
        SharingSample(link=INTER, first_ms=1.0, second_ms=1.0, together_ms=float("inf"))
    with pytest.raises(TypeError, match="slowdowns"):
        dataclasses.replace(emulated_cluster(), slowdowns=[])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sharing"):
        dataclasses.replace(emulated_cluster(), sharing=(1.0,))  # type: ignore[arg-type]


# -- renderings ---------------------------------------------------------------------------------


def test_format_iteration_rows_and_width() -> None:
    t = simulate_iteration(small(HSDP_ASYNC))
    text = format_iteration(t, width=57)
    lines = text.splitlines()
    assert lines[0].startswith("HYBRID_SHARD 2 x 8, async all-reduce: 57.0 ms per iteration, one column = 1.00 ms")
    assert lines[-1].startswith("  g/G forward/backward all-gather")
    rows = {line.split("|")[0].strip(): line.split("|")[1] for line in lines[1:-1]}
    assert list(rows) == ["compute", "all_gather", "post_backward", "all_reduce", "intra_node", "inter_node"]
    assert all(len(row) == 57 for row in rows.values())
    # u2's all-reduce runs 17-37 ms and u1's 37-57: one column per ms.
    assert rows["all_reduce"] == " " * 17 + "A" * 40
    assert rows["compute"][3] == "f" and rows["compute"][11:13] == "bb"
    with pytest.raises(ValueError, match="width"):
        format_iteration(t, width=5)


def test_format_iteration_counts_collectives_sharing_a_link() -> None:
    t = simulate_iteration(small(FSDP), LinkModel(one_collective_per_group=False))
    row = next(line for line in format_iteration(t, width=62).splitlines() if line.startswith("  inter_node"))
    assert row.split("|")[1][34:50] == "2" * 16


def test_iteration_to_trace() -> None:
    t = simulate_iteration(small(HSDP_SYNC))
    trace = iteration_to_trace(t, name="small")
    assert json.loads(json.dumps(trace)) == trace
    events = trace["traceEvents"]
    assert isinstance(events, list) and trace["displayTimeUnit"] == "ms"
    complete = [e for e in events if isinstance(e, dict) and e["ph"] == "X"]
    assert len(complete) == len(t.intervals)
    names = [e["args"] for e in events if isinstance(e, dict) and e["name"] in ("process_name", "thread_name")]
    assert names == [{"name": n} for n in ("small", "compute", "all_gather", "post_backward", "all_reduce")]
    ar = next(e for e in complete if e["name"] == "u1 all_reduce")
    assert (ar["ts"], ar["dur"]) == (40_000.0, 20_000.0)
    counters = [e for e in events if isinstance(e, dict) and e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"intra_node collectives", "inter_node collectives"}
    assert all(isinstance(e["args"], dict) and e["args"]["active"] in (0, 1) for e in counters)


def test_activity_marks_cover_every_activity() -> None:
    assert set(ACTIVITY_MARKS) == set(Activity) and len(set(ACTIVITY_MARKS.values())) == len(Activity)


# -- one cost model ------------------------------------------------------------------------------


def test_units_without_given_costs_are_priced_by_the_cost_model_from_their_plans() -> None:
    """A bf16 unit of 1000 elements reduced in fp32 over 2 ranks of one node: its plan casts the
    gradient (2000 B read + 4000 B written) and divides it (4000 B read and written), then
    reduce-scatters it (500 fp32 elements leave each rank: 2000 B on the wire); its all-gather
    sends 500 bf16 elements (1000 B). Every op is priced by the same ``CostModel`` that prices
    ``simulate_timeline``."""
    layout = FlatParamLayout.of([("w", (1000,))], torch.float32)
    sharding = ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 2)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = plan_post_backward(layout, sharding, mixed_precision=mp)
    cost = CostModel(device_bandwidth=1e6, intra_node_bandwidth=1e6, inter_node_bandwidth=1e5, collective_latency=1e-3)
    units = tuple(UnitCosts(name=n, forward_ms=1, backward_ms=2) for n in ("root", "u1"))
    t = simulate_iteration(IterationModel(units=units, plans=(plan, plan), cost=cost))
    rs = t.find(Activity.REDUCE_SCATTER, 1)
    assert rs.link is INTRA and rs.duration_ms == pytest.approx(1 + 2000 / 1e6 * 1e3)
    gather = t.find(Activity.FORWARD_ALL_GATHER, 1)
    assert gather.duration_ms == pytest.approx(1 + 1000 / 1e6 * 1e3)
    elementwise = [i for i in t.intervals if i.activity is Activity.ELEMENTWISE and i.unit == 1]
    assert [round(i.duration_ms, 6) for i in elementwise] == [6.0, 8.0]
    assert all(i.stream is Stream.POST_BACKWARD for i in elementwise)
    timeline = {e.op: e for e in simulate_timeline(plan, cost) if e.op == "reduce_scatter"}
    assert (timeline["reduce_scatter"].end - timeline["reduce_scatter"].start) * 1e3 == pytest.approx(rs.duration_ms)


def test_timed_collectives_replace_latency_and_bandwidth() -> None:
    fits = fit_collectives(emulated_cluster().samples)
    cost = CostModel(measured=fits.table())
    volume = comm_volume(
        plan_post_backward(
            FlatParamLayout.of([("w", (1000,))], torch.float32), ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 2)
        )
    )
    (rs,) = [v for v in volume if v.collective == "reduce_scatter"]
    assert cost.collective_seconds(rs, INTRA) * 1e3 == pytest.approx(fits.reduce_scatter_intra.ms(4000))
    assert cost.collective_seconds(rs, INTER) * 1e3 == pytest.approx(fits.reduce_scatter_inter.ms(4000))
    assert "timed collectives as fitted" in describe_cost(cost) and "fitted" not in describe_cost(CostModel())
    table = fit_table([s for s in emulated_cluster().samples if s.link is INTER])
    assert [(c, link) for c, link, _ in table] == [
        (Collective.ALL_GATHER, INTER),
        (Collective.REDUCE_SCATTER, INTER),
        (Collective.ALL_REDUCE, INTER),
    ]


def two_units(sharding: ShardingSpec) -> tuple[tuple[UnitSpec, ...], ActivationTrace]:
    """Unit 0 (1000 elements) inside the root, unit 1 (30): their specs and a traced chain."""
    units = tuple(
        UnitSpec(request=PlanRequest(layout=FlatParamLayout.of([("w", (n,))], torch.float32), sharding=sharding))
        for n in (1000, 30)
    )
    strategy = sharding.strategy
    trace = ActivationTrace.chain(
        UnshardRequest(
            units=2,
            root=1,
            forward_order=(1, 0),
            backward_order=(1, 0),
            reshard_after_forward=strategy.reshards_after_forward,
            plan_reshards=strategy.is_sharded,
            reshard_at_end_of_backward=strategy.is_sharded,
        ),
        saved=[10, 10],
        grads=[4000, 120],
    )
    return units, trace


def test_a_models_real_units_make_the_iteration() -> None:
    """``model_of_units``: the units' own plans (their sharding and placement), the recorded
    orders, compute from traced FLOPs: here 1e9 FLOP/s, so 30 and 700 FLOPs are 3e-5 and 7e-4 ms."""
    units, trace = two_units(ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 4, 2))
    trace = ActivationTrace(
        points=tuple(
            dataclasses.replace(p, flops=30 if p.at == HookEvent(Event.PRE_FORWARD, 0) else 0) for p in trace.points
        )
    )
    compute = flops_compute_ms(trace, 2, 1, 1e9)
    model = model_of_units(units, trace, root=1, compute_ms=compute, ranks_per_node=2)
    assert [u.name for u in model.units] == ["unit 0", "root"]
    assert model.units[0].forward_ms == pytest.approx(30 / 1e9 * 1e3)
    assert model.unshard is not None and model.unshard.root == 1
    t = simulate_iteration(model)
    assert {i.stream for i in t.intervals if i.activity is Activity.ALL_REDUCE} == {Stream.ALL_REDUCE}
    assert t.find(Activity.REDUCE_SCATTER, 0).link is INTRA and t.find(Activity.ALL_REDUCE, 0).link is INTER
    quiet = simulate_iteration(model_of_units(units, trace, root=1, compute_ms=compute, sync=False))
    assert not any(i.activity in (Activity.REDUCE_SCATTER, Activity.ALL_REDUCE) for i in quiet.intervals)
    with pytest.raises(ValueError, match="flops_per_second"):
        flops_compute_ms(trace, 2, 1, 0)
    with pytest.raises(ValueError, match="compute_ms"):
        model_of_units(units, trace, root=1, compute_ms=compute[:1])


def test_the_backward_ends_with_the_shells_event_check() -> None:
    """The shell ends every backward with its event check (``check_same_events``): the host
    all-gathers one int64 per rank over every rank after the last post-backward hook and waits.
    Here ``NO_SHARD`` on the CPU runtime (its all-reduces synchronous, so nothing shares the
    link with the check), 4 ranks, 2 per node: 32 bytes on the inter-node link, 0.5 ms by the
    measured table (0.5 ms at 32 bytes, 1.5 at 1032), added to the iteration; 0.25 ms when its
    measured time is given. A world of one rank has no check, nor a model without it."""
    table = fit_table(
        [
            CollectiveSample(collective=Collective.ALL_GATHER, link=Link.INTER_NODE, nbytes=32, ms=0.5),
            CollectiveSample(collective=Collective.ALL_GATHER, link=Link.INTER_NODE, nbytes=1032, ms=1.5),
        ]
    )

    def iteration(sharding: ShardingSpec, event_check: bool = True, ms: float | None = None) -> IterationTimeline:
        units, trace = two_units(sharding)
        model = model_of_units(
            units,
            trace,
            root=1,
            compute_ms=((1.0, 2.0), (1.0, 2.0)),
            cost=CostModel(measured=table),
            ranks_per_node=2,
            executor=Executor.CPU_LANE,
            event_check=event_check,
            event_check_ms=ms,
        )
        return simulate_iteration(model)

    world = ShardingSpec.for_world(ShardingStrategy.NO_SHARD, 4)
    checked, unchecked = iteration(world), iteration(world, event_check=False)
    check = checked.find(Activity.EVENT_CHECK, 1)
    assert check.link is INTER and check.duration_ms == pytest.approx(0.5)
    assert check.start_ms == pytest.approx(unchecked.iteration_ms) and checked.intervals[-1] is check
    assert checked.iteration_ms == pytest.approx(unchecked.iteration_ms + 0.5)
    assert not any(i.activity is Activity.EVENT_CHECK for i in unchecked.intervals)
    timed = iteration(world, ms=0.25)
    assert timed.iteration_ms == pytest.approx(unchecked.iteration_ms + 0.25)
    with pytest.raises(ValueError, match="event_check_ms"):
        iteration(world, ms=-1.0)
    assert "E end-of-backward event check" in format_iteration(checked)
    assert "E end-of-backward" not in format_iteration(unchecked)
    alone = iteration(ShardingSpec.for_world(ShardingStrategy.NO_SHARD, 1))
    assert not any(i.activity is Activity.EVENT_CHECK for i in alone.intervals)
    units, trace = two_units(world)
    model = model_of_units(units, trace, root=1, compute_ms=((1.0, 2.0), (1.0, 2.0)))
    with pytest.raises(TypeError, match="event_check"):
        dataclasses.replace(model, event_check=1)  # type: ignore[arg-type]  # the wrong type is the test


@pytest.mark.parametrize(
    ("strategy", "fresh_gathers", "later_gathers", "kept"),
    [
        (ShardingStrategy.SHARD_GRAD_OP, 2, 0, True),
        (ShardingStrategy.FULL_SHARD, 3, 3, False),
        (ShardingStrategy.NO_SHARD, 0, 0, True),
    ],
)
def test_after_no_sync_zero2_starts_gathered_and_each_plan_adds_the_carried_gradient(
    strategy: ShardingStrategy, fresh_gathers: int, later_gathers: int, kept: bool
) -> None:
    """Inside ``no_sync()`` ``SHARD_GRAD_OP`` keeps the unsharded parameters (FSDP1's
    ``_should_free_in_backward``): the forward-backward after it all-gathers nothing, where a
    fresh one gathers both units in forward (2). ``FULL_SHARD`` resharded them: the root in
    forward, unit 0 in forward and again in backward (3), after ``no_sync`` as before.
    ``NO_SHARD`` never gathers, its parameters always whole. Every
    plan after ``no_sync`` starts with the unsharded gradient the ``no_sync`` plan handed off."""
    units, trace = two_units(ShardingSpec.for_world(strategy, 2))
    gathers = (Activity.FORWARD_ALL_GATHER, Activity.BACKWARD_ALL_GATHER)
    for sync in (True, False):
        fresh, later = (
            model_of_units(units, trace, root=1, compute_ms=((1.0, 2.0), (1.0, 2.0)), sync=sync, follows_no_sync=f)
            for f in (False, True)
        )
        assert later.gathered_at_start == (frozenset({0, 1}) if kept else frozenset()) and not fresh.gathered_at_start
        assert sum(i.activity in gathers for i in simulate_iteration(fresh).intervals) == fresh_gathers
        assert sum(i.activity in gathers for i in simulate_iteration(later).intervals) == later_gathers
        for before, after in zip(fresh.plans, later.plans):
            assert before is not None and after is not None
            assert not before.request.flags.pending_unsharded and after.request.flags.pending_unsharded
            assert after.request.flags.sync_gradients is sync


def test_the_cpu_runtime_by_hand() -> None:
    """``Executor.CPU_LANE``: the host thread computes and issues and waits for each shard-group
    reduce-scatter; the replicate all-reduce runs on the lane. Async HSDP of the small model
    (one collective per group): forward as on streams (0-8); u2's backward 11-13 after its
    prefetched all-gather (8-11); its reduce-scatter on the host after u1's all-gather on the
    shard group (11-14): 14-17, and u1's backward only after it, 17-19; u2's all-reduce on the
    lane 17-37, u1's 37-57. At the root's plan the host waits for the lane work of the plan
    before the last (u2's all-reduce): the root's reduce-scatter (free) at 37."""
    t = simulate_iteration(dataclasses.replace(small(HSDP_ASYNC), executor=Executor.CPU_LANE))
    assert at(t, Activity.BACKWARD, 2) == (11, 13) and at(t, Activity.BACKWARD_ALL_GATHER, 1) == (11, 14)
    assert at(t, Activity.REDUCE_SCATTER, 2) == (14, 17) and t.find(Activity.REDUCE_SCATTER, 2).stream is Stream.COMPUTE
    assert at(t, Activity.BACKWARD, 1) == (17, 19) and at(t, Activity.REDUCE_SCATTER, 1) == (19, 22)
    assert at(t, Activity.ALL_REDUCE, 2) == (17, 37) and at(t, Activity.ALL_REDUCE, 1) == (37, 57)
    assert at(t, Activity.REDUCE_SCATTER, 0) == (37, 37)
    assert t.iteration_ms == 57
    # On device streams u1's backward overlaps u2's reduce-scatter instead: 14-16.
    assert at(simulate_iteration(small(HSDP_ASYNC)), Activity.BACKWARD, 1) == (14, 16)
    # Sync HSDP on the CPU: the lane issues the shard group's collectives too (the all-gathers have
    # a group of their own), so u1's reduce-scatter queues behind u2's all-reduce on the lane.
    sync = simulate_iteration(dataclasses.replace(small(HSDP_SYNC), executor=Executor.CPU_LANE))
    assert (
        at(sync, Activity.REDUCE_SCATTER, 1) == (37, 40)
        and sync.find(Activity.REDUCE_SCATTER, 1).stream is Stream.POST_BACKWARD
    )
