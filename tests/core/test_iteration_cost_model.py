"""One cost model for the iteration and the plan timeline: units priced from their plans or by
timed collectives, a model's real units with traced FLOPs, the shell's end-of-backward event
check, the iteration after ``no_sync``, and the CPU runtime. Expected times are worked out by
hand.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp_core import (
    Event,
    FlatParamLayout,
    HookEvent,
    MixedPrecision,
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
    Activity,
    Collective,
    CollectiveSample,
    CostModel,
    IterationModel,
    IterationTimeline,
    Link,
    UnitCosts,
    describe_cost,
    fit_collectives,
    fit_table,
    flops_compute_ms,
    format_iteration,
    model_of_units,
    simulate_iteration,
    simulate_timeline,
)
from tests.core.iteration_cases import HSDP_ASYNC, HSDP_SYNC, INTER, INTRA, at, emulated_cluster, small

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
