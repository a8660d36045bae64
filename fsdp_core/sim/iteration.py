"""One training iteration of a model of several FSDP units, simulated on FSDP1's streams.

What runs, per unit, in FSDP1's order (``plan_unshard`` gives the all-gather actions; unit 0 is
the root, which wraps the others and keeps its parameters gathered from forward to backward):

- **forward**: the unit's all-gather on ``Stream.ALL_GATHER``, then its forward on
  ``Stream.COMPUTE``, which waits for it. FSDP1's default has no forward prefetch, so a unit's
  all-gather is issued in its own pre-forward hook and its forward waits for all of it.
- **backward**: with ``BACKWARD_PRE`` (the default) each unit's pre-backward issues the next
  unit's all-gather, which runs while this unit's backward computes; the root's pre-backward
  issues the first. Then the unit's backward on compute; in its post-backward hook (after any
  ``BACKWARD_POST`` prefetch, as FSDP1 reshards and prefetches before it reduces) the ops of the
  unit's post-backward ``Plan``, as the shell runs them: each collective (reduce-scatter,
  all-reduce, comm hook) on the plan's stream and group, after what the plan's ``WaitStream``
  ops make it wait for. So where the hybrid replicate all-reduce runs is the planner's decision
  (``all_reduce_stream``): on ``Stream.POST_BACKWARD`` right after the reduce-scatter (sync,
  FSDP1 before PyTorch PR 106080: the next reduce-scatter waits for it) or on
  ``Stream.ALL_REDUCE`` (async: it waits only for its reduce-scatter). The root's own backward
  runs last.
- **end of backward**: the compute stream waits for every side stream; the iteration ends when
  the last task does. The optimizer step is not modelled.

Timing rules:

- *Host in step.* A hook fires when the compute stream reaches it: a collective issued from a
  hook starts no earlier than the end of the compute work enqueued before that hook. (A real
  host may run ahead of the device, which FSDP1's ``limit_all_gathers`` bounds; that implicit
  forward overlap is not modelled — ``forward_prefetch=True`` is the explicit kind.)
- *Streams* run their tasks one at a time, in the order they were enqueued.
- *One collective per process group* (``LinkModel.one_collective_per_group``, default True):
  ProcessGroupNCCL runs a group's collectives on one internal stream, in the order the host
  issued them, whatever CUDA stream issued them; so FSDP1's all-gathers and reduce-scatters (one
  shard group) never run at the same time, while the replicate all-reduce (another group) does.
- *Links* (``fsdp_core.sim.links``): a group of consecutive ranks that fits in one node
  (``IterationModel.ranks_per_node``) uses ``Link.INTRA_NODE``, one that spans nodes
  ``Link.INTER_NODE``: FSDP's shard group over the whole world spans nodes, HSDP's is one node,
  its replicate group spans them. A collective's work is its cost measured alone on its link;
  collectives active on one link at once share it (processor sharing with ``contention``).
  Where ranks share processor cores with their communication (the emulated cluster of
  ``benchmarks/bench_hsdp_cluster.py``), ``LinkModel`` also slows intra-node collectives while an
  inter-node one runs (``cross_link_slowdown``) and each collective while compute runs
  (``compute_slowdown``, per collective and link), and compute while any collective runs
  (``transfers_slow_compute``); on GPUs with NCCL these stay 1.

Everything is exact (``Fraction``) and deterministic; the result is an ``IterationTimeline``
with every interval, the iteration time, each unit's exposed communication (not overlapped by
compute) and the link that limits the iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import assert_never

from fsdp_core.execution import Place, gather_waits, lane_issues_shard
from fsdp_core.memory.plan_memory import Executor, backward_memory
from fsdp_core.plan.comm import all_gather_volume, comm_volume
from fsdp_core.plan.ops import (
    Accumulate,
    AllReduce,
    AllReduceHookCall,
    Cast,
    CommHookCall,
    CopyIn,
    Divide,
    EndOfBackwardWait,
    Free,
    FreeUnshardedParam,
    GradViews,
    Group,
    HandOff,
    Input,
    Offload,
    Op,
    Pad,
    RecordStream,
    ReduceScatter,
    Stream,
    WaitStream,
)
from fsdp_core.plan.request import Plan
from fsdp_core.sim.iteration_model import (
    Activity,
    IterationModel,
    LinkModel,
    describe_plans,
    event_check_volume,
)
from fsdp_core.sim.iteration_timeline import Interval, IterationTimeline
from fsdp_core.sim.links import Link, SimTask, group_link, run_tasks, span_link
from fsdp_core.sim.timeline import elementwise_bytes
from fsdp_core.spec.events import Event
from fsdp_core.unshard.schedule import AwaitGather, Gather, Reshard, UnshardRequest, plan_unshard

__all__ = ["simulate_iteration"]


@dataclass(frozen=True, slots=True)
class _Label:
    unit: int
    activity: Activity
    stream: Stream
    group: Group | None
    link: Link | None


_BACKWARD_EVENTS = (Event.PRE_BACKWARD, Event.POST_BACKWARD)


def _tasks(model: IterationModel, links: LinkModel) -> tuple[list[SimTask], list[_Label]]:
    """The iteration as tasks in host order, each after what it waits for (module docstring)."""
    request = model.unshard or UnshardRequest.chain(
        len(model.units),
        reshard_after_forward=True,
        plan_reshards=True,
        backward_prefetch=model.backward_prefetch,
        forward_prefetch=model.forward_prefetch,
    )
    actions = plan_unshard(request)
    some = next((p for p in model.plans if p is not None), None)
    sharding = None if some is None else some.request.sharding
    cpu = model.executor is Executor.CPU_LANE
    places = _cpu_places(model, request) if cpu else {}
    lane_tasks: list[int | None] = []
    """By lane ticket - 1: the CPU lane's last task once that ticket's work was queued."""

    def link_of(group: Group) -> Link:
        assert sharding is not None
        return group_link(group, sharding, model.ranks_per_node)

    tasks: list[SimTask] = []
    labels: list[_Label] = []
    last_on: dict[Stream | str, int] = {}
    """The last task of each queue: a stream, or the CPU's lane (``_LANE``)."""
    last_in: dict[Group, int] = {}
    gathered: dict[int, int | None] = dict.fromkeys(model.gathered_at_start)
    """unit -> its all-gather task while gathered or in flight; None: gathered before the iteration."""
    awaited: list[int] = []  # all-gathers the next compute task waits for
    parted: set[int] = set()  # units resharded to a smaller group after forward (hpZ)
    host_waits: set[int] = set()  # lane tasks the host waits for before its next task

    def add(
        unit: int,
        activity: Activity,
        stream: Stream,
        ms: float,
        *,
        group: Group | None = None,
        link: Link | None = None,
        after: tuple[int, ...] = (),
        queue: Stream | str | None = None,
    ) -> int:
        """A task on ``queue`` (default: ``stream``), shown on ``stream``."""
        queue = stream if queue is None else queue
        deps = set(after)
        if queue in last_on:
            deps.add(last_on[queue])
        if queue is not Stream.COMPUTE and Stream.COMPUTE in last_on:
            deps.add(last_on[Stream.COMPUTE])  # the host is in step with the compute stream
        if queue is Stream.COMPUTE:
            deps |= host_waits
            host_waits.clear()
        if group is not None and links.one_collective_per_group and group in last_in:
            deps.add(last_in[group])
        index = len(tasks)
        slowdown = Fraction(1) if link is None else Fraction(links.compute_slowdown.of(activity, link))
        tasks.append(SimTask(after=tuple(sorted(deps)), work=Fraction(ms), link=link, compute_slowdown=slowdown))
        labels.append(_Label(unit=unit, activity=activity, stream=stream, group=group, link=link))
        last_on[queue] = index
        if group is not None:
            last_in[group] = index
        return index

    def compute(unit: int, activity: Activity, ms: float) -> int:
        index = add(unit, activity, Stream.COMPUTE, ms, after=tuple(awaited))
        awaited.clear()
        return index

    def hook(event: Event, unit: int) -> None:
        activity = Activity.BACKWARD_ALL_GATHER if event in _BACKWARD_EVENTS else Activity.FORWARD_ALL_GATHER
        for action in actions.actions(event, unit):
            match action:
                case Gather():
                    plan = model.plans[action.unit]
                    small = model.units[action.unit].post_forward_ranks if action.unit in parted else 0
                    parted.discard(action.unit)
                    volume = None if plan is None else all_gather_volume(plan.request, small or None)
                    if action.unit not in gathered and volume is not None:
                        link = span_link(small, model.ranks_per_node) if small else link_of(Group.SHARD)
                        given = model.units[action.unit].collectives
                        cost = given.all_gather_ms(link) if given else model.cost.collective_seconds(volume, link) * 1e3
                        blocking = cpu and gather_waits(volume.output_bytes)
                        gathered[action.unit] = add(
                            action.unit,
                            activity,
                            Stream.ALL_GATHER,
                            cost,
                            group=Group.SHARD,
                            link=link,
                            queue=Stream.COMPUTE if blocking else None,
                        )
                case AwaitGather():
                    if (task := gathered.get(action.unit)) is not None:
                        awaited.append(task)
                case Reshard():
                    if gathered.pop(action.unit, -1) != -1 and model.units[action.unit].post_forward_ranks:
                        parted.add(action.unit)  # resharded to a smaller group: gathered over it next
                case _:
                    assert_never(action)

    def post_backward(unit: int, plan: Plan) -> None:
        """The plan's hook ops: each collective a transfer on its stream and group, and, priced by
        the cost model, each element-wise op work on its stream; each after what the plan's waits
        name. With given ``CollectiveCosts`` element-wise ops take no time."""
        waits: dict[Stream, set[int]] = {}
        given = model.units[unit].collectives
        volumes = {v.op_index: v for v in comm_volume(plan)}
        placed, waits_through = places.get(unit, ((), 0))
        if cpu and waits_through > 0 and (mark := lane_tasks[waits_through - 1]) is not None:
            host_waits.add(mark)
        current = 0

        def on_stream(stream: Stream, activity: Activity, ms: float, group: Group | None = None) -> None:
            link = None if group is None else link_of(group)
            if not cpu:
                add(unit, activity, stream, ms, group=group, link=link, after=tuple(waits.pop(stream, ())))
                return
            place = placed[current]
            if place is Place.HOST_AFTER_DRAIN and _LANE in last_on:
                host_waits.add(last_on[_LANE])
            on_lane = place is Place.LANE
            shown = stream if on_lane else Stream.COMPUTE
            add(unit, activity, shown, ms, group=group, link=link, queue=_LANE if on_lane else Stream.COMPUTE)

        def elementwise(stream: Stream, seconds: float) -> None:
            if given is None:
                on_stream(stream, Activity.ELEMENTWISE, seconds * 1e3)

        def run_op(index: int, op: Op) -> None:
            match op:
                case WaitStream():
                    if op.waits_for in last_on:
                        waits.setdefault(op.stream, set()).add(last_on[op.waits_for])
                case ReduceScatter() | AllReduce() | CommHookCall():
                    volume = volumes[index]
                    link = link_of(op.group)
                    scatter = volume.collective == "reduce_scatter"
                    activity = Activity.REDUCE_SCATTER if scatter else Activity.ALL_REDUCE
                    if given is None:
                        ms = model.cost.collective_seconds(volume, link) * 1e3
                    else:
                        ms = given.reduce_scatter_ms(link) if scatter else given.all_reduce_ms(link)
                    on_stream(op.stream, activity, ms, op.group)
                case Cast() | Pad() | CopyIn() | Divide() | Accumulate():
                    elementwise(op.stream, model.cost.elementwise_seconds(elementwise_bytes(op)))
                case Offload():
                    elementwise(op.stream, model.cost.host_copy_seconds(op.src.nbytes))
                case FreeUnshardedParam():
                    gathered.pop(unit, None)
                case Input() | RecordStream() | Free() | GradViews() | HandOff() | EndOfBackwardWait():
                    pass
                case AllReduceHookCall():  # the user's work, not modeled
                    pass
                case _:
                    assert_never(op)

        for index, op in enumerate(plan.hook_ops):
            current = index
            run_op(index, op)
            if cpu and placed[index] is Place.LANE:
                lane_tasks.append(last_on.get(_LANE))

    for event, unit in request.events:
        if unit < 0:
            continue
        costs = model.units[unit]
        match event:
            case Event.PRE_FORWARD:
                hook(event, unit)
                compute(unit, Activity.FORWARD, costs.forward_ms)
            case Event.POST_FORWARD:
                hook(event, unit)
            case Event.PRE_BACKWARD:
                hook(event, unit)
                if unit != request.root:
                    compute(unit, Activity.BACKWARD, costs.backward_ms)
            case Event.POST_BACKWARD:
                if unit == request.root:
                    compute(unit, Activity.BACKWARD, costs.backward_ms)
                hook(event, unit)
                plan = model.plans[unit]
                if plan is not None:
                    post_backward(unit, plan)
            case Event.END_FORWARD | Event.END_BACKWARD:
                pass
            case _:
                assert_never(event)
    if model.event_check and sharding is not None and (check := event_check_volume(sharding)).group_size > 1:
        link = span_link(check.group_size, model.ranks_per_node)
        given = model.event_check_ms
        ms = model.cost.collective_seconds(check, link) * 1e3 if given is None else given
        add(request.root, Activity.EVENT_CHECK, Stream.COMPUTE, ms, link=link, after=tuple(awaited))
    return tasks, labels


_LANE = "lane"
"""The queue of the CPU runtime's lane thread."""


def _cpu_places(model: IterationModel, request: UnshardRequest) -> dict[int, tuple[tuple[Place, ...], int]]:
    """Where the CPU runtime runs each op of each unit's plan, and the lane ticket the host waits
    through as the plan begins, as ``backward_memory`` walks the backward's plans in the order
    their hooks fire (one ``LaneOrder`` carried from plan to plan)."""
    order = [u for e, u in request.events if e is Event.POST_BACKWARD and model.plans[u] is not None]
    plans = [p for u in order if (p := model.plans[u]) is not None]
    sync = any(lane_issues_shard(p.request.hybrid_all_reduce) for p in plans)
    backward = backward_memory(plans, Executor.CPU_LANE, lane_issues_shard=sync)
    return {u: (hook.memory.places, hook.waited_through) for u, hook in zip(order, backward.hooks)}


def _critical_path(tasks: Sequence[SimTask], times: Sequence[tuple[Fraction, Fraction]]) -> tuple[int, ...]:
    """From the task that ends last, back through the task each waited for that ended last."""
    if not tasks:
        return ()
    index = max(range(len(tasks)), key=lambda k: (times[k][1], k))
    path = [index]
    while tasks[index].after:
        index = max(tasks[index].after, key=lambda k: (times[k][1], k))
        path.append(index)
    return tuple(path)


def simulate_iteration(model: IterationModel, links: LinkModel = LinkModel()) -> IterationTimeline:
    """Simulate one iteration of ``model`` (its units' plans and costs) under ``links`` (module
    docstring).

    Exact and deterministic: equal arguments give equal timelines. Costs in ms; each interval's
    times are the exact event times rounded to the nearest float.
    """
    if not isinstance(model, IterationModel):
        raise TypeError(f"model: expected an IterationModel, got {type(model).__name__}")
    if not isinstance(links, LinkModel):
        raise TypeError(f"links: expected a LinkModel, got {type(links).__name__}")
    tasks, labels = _tasks(model, links)
    capacity = {
        Link.INTER_NODE: Fraction(links.inter_node_bandwidth),
        Link.INTRA_NODE: Fraction(links.intra_node_bandwidth),
    }
    times = run_tasks(
        tasks,
        capacity=capacity,
        contention=Fraction(links.contention),
        cross_link_slowdown=Fraction(links.cross_link_slowdown),
        transfers_slow_compute=Fraction(links.transfers_slow_compute),
    )
    intervals = tuple(
        Interval(
            unit=label.unit,
            name=model.units[label.unit].name,
            activity=label.activity,
            stream=label.stream,
            group=label.group,
            link=label.link,
            start_ms=float(start),
            end_ms=float(end),
        )
        for label, (start, end) in zip(labels, times)
    )
    end = max((e for _, e in times), default=Fraction(0))
    return IterationTimeline(
        label=describe_plans(model.plans),
        links=links,
        intervals=intervals,
        iteration_ms=float(end),
        critical=_critical_path(tasks, times),
    )
