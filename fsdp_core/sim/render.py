"""A simulated iteration for people (an ASCII chart) and for trace viewers (Chrome/Perfetto JSON)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from fsdp_core.plan.ops import Stream
from fsdp_core.problems import JsonValue
from fsdp_core.sim.iteration_model import Activity
from fsdp_core.sim.iteration_timeline import Interval, IterationTimeline
from fsdp_core.sim.links import Link

__all__ = ["ACTIVITY_MARKS", "format_iteration", "iteration_to_trace"]

ACTIVITY_MARKS: Mapping[Activity, str] = MappingProxyType(
    {
        Activity.FORWARD_ALL_GATHER: "g",
        Activity.FORWARD: "f",
        Activity.BACKWARD_ALL_GATHER: "G",
        Activity.BACKWARD: "b",
        Activity.REDUCE_SCATTER: "R",
        Activity.ALL_REDUCE: "A",
        Activity.ELEMENTWISE: "=",
        Activity.EVENT_CHECK: "E",
    }
)
"""The character ``format_iteration`` draws each activity with."""

_STREAMS = (Stream.COMPUTE, Stream.ALL_GATHER, Stream.POST_BACKWARD, Stream.ALL_REDUCE)


def _concurrency(intervals: list[Interval]) -> int:
    """The most of ``intervals`` that run at one instant (touching ends do not overlap)."""
    events = sorted(
        [(i.start_ms, 1) for i in intervals] + [(i.end_ms, -1) for i in intervals], key=lambda e: (e[0], e[1])
    )
    most = active = 0
    for _, step in events:
        active += step
        most = max(most, active)
    return most


def format_iteration(timeline: IterationTimeline, width: int = 100, name: str | None = None) -> str:
    """An ASCII chart of ``timeline``, ``width`` columns wide, headed ``name`` (its label by
    default): one row per stream that has work, then one row per link that carries any, where a
    digit counts collectives sharing the link; then a legend.

    Each interval covers the columns its time maps to, at least one; a later interval on the same
    row overwrites an earlier one in a shared column."""
    if width < 10:
        raise ValueError(f"width: expected >= 10 columns, got {width}")
    total = timeline.iteration_ms
    per_column = total / width if total > 0 else 1.0
    shown = [i for i in timeline.intervals if i.end_ms > i.start_ms]

    def span(i: Interval) -> range:
        lo = min(width - 1, int(i.start_ms / per_column))
        return range(lo, max(lo + 1, min(width, round(i.end_ms / per_column))))

    rows: list[str] = []
    for stream in _STREAMS:
        mine = [i for i in shown if i.stream is stream]
        if not mine:
            continue
        cells = [" "] * width
        for i in mine:
            for k in span(i):
                cells[k] = ACTIVITY_MARKS[i.activity]
        rows.append(f"  {stream.value:<14}|{''.join(cells)}|")
    for link in Link:
        mine = [i for i in shown if i.link is link]
        if not mine:
            continue
        covering: list[list[Interval]] = [[] for _ in range(width)]
        for i in mine:
            for k in span(i):
                covering[k].append(i)
        cells = [" "] * width
        for k, here in enumerate(covering):
            if here:
                shared = _concurrency(here)
                cells[k] = str(min(shared, 9)) if shared > 1 else ACTIVITY_MARKS[here[-1].activity]
        rows.append(f"  {link.value:<14}|{''.join(cells)}|")
    head = f"{name or timeline.label}: {total:.1f} ms per iteration, one column = {per_column:.2f} ms"
    checked = any(i.activity is Activity.EVENT_CHECK for i in timeline.intervals)
    legend = (
        "  g/G forward/backward all-gather, f forward, b backward, R reduce-scatter, A all-reduce, "
        f"= element-wise, {'E end-of-backward event check, ' if checked else ''}2-9 collectives sharing a link"
    )
    return "\n".join([head, *rows, legend])


def iteration_to_trace(timeline: IterationTimeline, *, name: str | None = None) -> dict[str, JsonValue]:
    """``timeline`` as a Chrome/Perfetto trace: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.

    One process (named ``name``, default the timeline's label); one thread track per stream with a
    complete (``"X"``) event per interval, ``ts``/``dur`` in microseconds, its unit, activity, group
    and link in ``args``; and per link a counter track of how many collectives are active on it.
    """
    pid = 1
    tids = {stream: k + 1 for k, stream in enumerate(_STREAMS)}
    events: list[JsonValue] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name or timeline.label}},
    ]
    for stream, tid in tids.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": stream.value}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for i in timeline.intervals:
        events.append(
            {
                "ph": "X",
                "name": f"{i.name} {i.activity.value}",
                "cat": i.activity.value,
                "pid": pid,
                "tid": tids[i.stream],
                "ts": i.start_ms * 1e3,
                "dur": i.duration_ms * 1e3,
                "args": {
                    "unit": i.unit,
                    "activity": i.activity.value,
                    "group": None if i.group is None else i.group.value,
                    "link": None if i.link is None else i.link.value,
                },
            }
        )
    for link in Link:
        changes: dict[float, int] = {}
        for i in timeline.intervals:
            if i.link is link and i.end_ms > i.start_ms:
                changes[i.start_ms] = changes.get(i.start_ms, 0) + 1
                changes[i.end_ms] = changes.get(i.end_ms, 0) - 1
        active = 0
        for at in sorted(changes):
            active += changes[at]
            events.append(
                {"ph": "C", "name": f"{link.value} collectives", "pid": pid, "ts": at * 1e3, "args": {"active": active}}
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
