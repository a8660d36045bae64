"""A simulated timeline: when each op of a plan would run on its stream, under a cost model.

Each stream runs its ops in order; a wait makes a stream start no earlier than the work it
waits for ended. Collectives over one group run one at a time, in the order they were issued (one
communicator, as with NCCL); every op is priced by the ``CostModel`` (``fsdp_core.sim.costs``),
the one the iteration simulator uses, the shard group inside a node and the replicate group
across nodes. Given an all-gather schedule, each unit's backward also waits for its parameter's
all-gather, issued on ``Stream.ALL_GATHER`` where the schedule says. The numbers are a model for
comparing plans, not a measurement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import assert_never

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
    op_name,
)
from fsdp_core.plan.request import Plan
from fsdp_core.problems import JsonValue
from fsdp_core.sim.costs import CostModel
from fsdp_core.sim.links import Link, group_link
from fsdp_core.spec.events import Event, HookEvent
from fsdp_core.unshard.schedule import AwaitGather, Gather, Reshard, UnshardSchedule

__all__ = ["TimelineEntry", "elementwise_bytes", "format_timeline", "simulate_timeline", "timeline_to_json"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TimelineEntry:
    """One op's simulated interval, in seconds from the first hook firing."""

    unit: int
    """Which unit the entry belongs to: the position of its post-backward (0 for the first), or,
    when an all-gather schedule is simulated, the schedule's unit index."""
    op_index: int
    op: str
    stream: Stream
    start: float
    end: float


_BACKWARD_EVENTS = (Event.PRE_BACKWARD, Event.POST_BACKWARD)


def elementwise_bytes(op: Op) -> int:
    """Device memory an element-wise op reads and writes; 0 for ops that move no elements on the
    device (bookkeeping, waits, and the collectives and offloads, which are costed by their link)."""
    match op:
        case Cast() | Pad() | CopyIn():
            return op.src.nbytes + op.dst.nbytes
        case Divide():
            return 2 * op.buffer.nbytes
        case Accumulate():
            return op.src.nbytes + 2 * op.dst.nbytes
        case (
            Input()
            | WaitStream()
            | RecordStream()
            | Free()
            | FreeUnshardedParam()
            | ReduceScatter()
            | AllReduce()
            | CommHookCall()
            | Offload()
            | GradViews()
            | AllReduceHookCall()
            | EndOfBackwardWait()
            | HandOff()
        ):
            return 0
        case _:
            assert_never(op)


def simulate_timeline(
    plan: Plan,
    cost: CostModel = CostModel(),
    *,
    units: int = 1,
    backward_seconds: float = 0.0,
    unshard: UnshardSchedule | None = None,
) -> tuple[TimelineEntry, ...]:
    """Start and end of every op of ``plan`` under ``cost``.

    ``units`` post-backwards of the same plan fire one after another, ``backward_seconds`` of
    compute-stream work apart (the backward of the next unit), as for a model of ``units``
    equal FSDP units; the end-of-backward ops run once, after the last. With hybrid strategies
    this shows the all-reduce of one unit overlapping the reduce-scatter of the next.

    With ``unshard``, the units are its ``backward_order`` (which must hold ``units`` units), their
    hooks fire in the order of its ``request.events`` (so the root's post-backward comes last), and
    the backward side of its schedule runs too: each unit's pre-backward actions when the compute
    stream reaches its backward, its post-backward actions after its hook ops. A ``Gather`` enqueues
    the unit's all-gather on ``Stream.ALL_GATHER`` (``latency + all_gather_volume bytes / shard
    link``, behind the shard-group collectives issued before it; a unit already gathered this
    backward is skipped); an ``AwaitGather`` holds the compute stream until that all-gather ends.
    Units never gathered in backward are taken to be still gathered from forward. A unit's
    post-backward and the next unit's pre-backward fire at the same instant here, so
    ``BACKWARD_POST`` and no prefetch both queue the next all-gather behind the reduce-scatter
    just issued; ``BACKWARD_PRE`` issues it a whole backward earlier, ahead of it.
    """
    if units < 1:
        raise ValueError(f"units: expected >= 1, got {units}")
    if backward_seconds < 0:
        raise ValueError(f"backward_seconds: expected >= 0, got {backward_seconds}")
    if unshard is None:
        hooks = tuple(HookEvent(e, u) for u in range(units) for e in _BACKWARD_EVENTS)
    else:
        if len(unshard.request.backward_order) != units:
            raise ValueError(
                f"unshard: the schedule's backward order has {len(unshard.request.backward_order)} "
                f"unit(s), expected units={units}"
            )
        hooks = tuple(h for h in unshard.request.events if h.event in _BACKWARD_EVENTS)
    volumes = {v.op_index: v for v in comm_volume(plan)}
    sharding = plan.request.sharding

    def link(group: Group) -> Link:
        """One shard group per node (intra-node), replicas across nodes."""
        return group_link(group, sharding, ranks_per_node=sharding.shard_size)

    gather = all_gather_volume(plan.request)
    gather_seconds = cost.collective_latency if gather is None else cost.collective_seconds(gather, link(Group.SHARD))
    now = dict.fromkeys(Stream, 0.0)
    busy = dict.fromkeys(Group, 0.0)
    gathered: dict[int, float] = {}
    out: list[TimelineEntry] = []
    hook = len(plan.hook_ops)

    def run(unit: int, index: int, op: Op) -> None:
        stream = op.stream
        start = now[stream]
        match op:
            case WaitStream() | EndOfBackwardWait():
                start = max(start, now[op.waits_for])
                duration = 0.0
            case ReduceScatter() | AllReduce() | CommHookCall():
                v = volumes[index]
                duration = cost.collective_seconds(v, link(v.group))
                start = max(start, busy[v.group])
                busy[v.group] = start + duration
            case Offload():
                duration = cost.host_copy_seconds(op.src.nbytes)
            case (
                Input()
                | RecordStream()
                | Free()
                | FreeUnshardedParam()
                | Cast()
                | Pad()
                | CopyIn()
                | Divide()
                | Accumulate()
                | GradViews()
                | AllReduceHookCall()
                | HandOff()
            ):
                duration = cost.elementwise_seconds(elementwise_bytes(op))
            case _:
                assert_never(op)
        now[stream] = start + duration
        out.append(
            TimelineEntry(unit=unit, op_index=index, op=op_name(op), stream=stream, start=start, end=start + duration)
        )

    def hook_actions(event: Event, unit: int) -> None:
        if unshard is None:
            return
        issued_at = now[Stream.COMPUTE]
        for action in unshard.actions(event, unit):
            match action:
                case Gather() if action.unit not in gathered:
                    start = max(now[Stream.ALL_GATHER], issued_at, busy[Group.SHARD])
                    now[Stream.ALL_GATHER] = busy[Group.SHARD] = gathered[action.unit] = start + gather_seconds
                    out.append(
                        TimelineEntry(
                            unit=action.unit,
                            op_index=-1,
                            op="all_gather",
                            stream=Stream.ALL_GATHER,
                            start=start,
                            end=start + gather_seconds,
                        )
                    )
                case AwaitGather():
                    now[Stream.COMPUTE] = max(now[Stream.COMPUTE], gathered.get(action.unit, 0.0))
                case Gather() | Reshard():
                    pass
                case _:
                    assert_never(action)

    for event, unit in hooks:
        if event is Event.PRE_BACKWARD:
            hook_actions(event, unit)
            if backward_seconds > 0:
                start = now[Stream.COMPUTE]
                now[Stream.COMPUTE] = start + backward_seconds
                out.append(
                    TimelineEntry(
                        unit=unit,
                        op_index=-1,
                        op="backward",
                        stream=Stream.COMPUTE,
                        start=start,
                        end=start + backward_seconds,
                    )
                )
        else:
            for index, op in enumerate(plan.ops[:hook]):
                run(unit, index, op)
            hook_actions(event, unit)
    for index, op in enumerate(plan.ops[hook:], start=hook):
        run(hooks[-1].unit, index, op)
    return tuple(out)


_MARKS: Mapping[str, str] = MappingProxyType(
    {"reduce_scatter": "R", "all_reduce": "A", "comm_hook": "H", "offload": "O", "backward": "b", "all_gather": "G"}
)
"""The chart's letter for an entry's ``op``; every other entry that takes time is drawn ``=``."""


def format_timeline(entries: tuple[TimelineEntry, ...], width: int = 64) -> str:
    """An ASCII chart of ``entries``: one row per stream (``all_gather`` only when it has
    entries), then the ops that take time."""
    total = max((e.end for e in entries), default=0.0)
    units = {e.unit for e in entries}
    scale = width / total if total > 0 else 0.0
    gathers = any(e.stream is Stream.ALL_GATHER for e in entries)
    rows = []
    for stream in Stream:
        if stream is Stream.ALL_GATHER and not gathers:
            continue
        cells = [" "] * width
        for e in entries:
            if e.stream is not stream or e.end <= e.start:
                continue
            lo = min(width - 1, int(e.start * scale))
            hi = max(lo + 1, min(width, round(e.end * scale)))
            for k in range(lo, hi):
                cells[k] = _MARKS.get(e.op, "=")
        rows.append(f"  {stream.value:<14}|{''.join(cells)}|")
    legend = "b backward, " + ("G all-gather, " if gathers else "")
    lines = [
        f"simulated timeline: {total * 1e3:.3f} ms ({legend}R reduce-scatter, A all-reduce, "
        f"H comm hook, O offload, = element-wise)"
    ]
    lines += rows
    for e in entries:
        if e.end > e.start:
            unit = f"unit {e.unit} " if len(units) > 1 else ""
            index = "  -" if e.op_index < 0 else f"{e.op_index:>3}"
            lines.append(
                f"  {unit}op{index} {e.op:<15} {e.stream.value:<14} {e.start * 1e3:9.3f} -> {e.end * 1e3:9.3f} ms"
            )
    return "\n".join(lines)


def timeline_to_json(entries: tuple[TimelineEntry, ...]) -> list[JsonValue]:
    """Each entry as ``{unit, op_index, op, stream, start, end}``, times in seconds."""
    return [
        {"unit": e.unit, "op_index": e.op_index, "op": e.op, "stream": e.stream.value, "start": e.start, "end": e.end}
        for e in entries
    ]
