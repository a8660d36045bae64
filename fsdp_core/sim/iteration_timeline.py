"""The result of a simulated iteration: every interval of every task (``Interval``) and what
follows from them (``IterationTimeline``: the iteration's time, each unit's exposed
communication, the link that limits it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fsdp_core.plan.ops import (
    Group,
    Stream,
)
from fsdp_core.sim.iteration_model import Activity, LinkModel
from fsdp_core.sim.links import Link

__all__ = [
    "Interval",
    "IterationTimeline",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """One task of the iteration: when it ran, where."""

    unit: int
    """The unit's index in ``IterationModel.units``."""
    name: str
    """The unit's name."""
    activity: Activity
    stream: Stream
    group: Group | None
    """The process group of a collective; None for compute."""
    link: Link | None
    """The link a collective used; None for compute."""
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        """``end_ms - start_ms``."""
        return self.end_ms - self.start_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class IterationTimeline:
    """The simulated iteration: every interval, in the order the host enqueued them."""

    label: str
    """What was simulated (``describe_plans``)."""
    links: LinkModel
    intervals: tuple[Interval, ...]
    iteration_ms: float
    """When the last task ends (the end-of-backward wait), in ms from the first hook."""
    critical: tuple[int, ...] = ()
    """Indices into ``intervals`` of the critical path, last first: from the interval that ends
    the iteration back through, each time, what it waited for that ended last."""

    def find(self, activity: Activity, unit: int) -> Interval:
        """The interval of ``activity`` for ``unit``; ``KeyError`` if it has none."""
        for interval in self.intervals:
            if interval.activity is activity and interval.unit == unit:
                return interval
        raise KeyError(f"no {activity.value} interval for unit {unit}")

    def on(self, stream: Stream) -> tuple[Interval, ...]:
        """The intervals of ``stream``, in the order they ran."""
        return tuple(i for i in self.intervals if i.stream is stream)

    def exposed_ms(self, unit: int) -> float:
        """How long ``unit``'s collectives ran while no forward or backward did: the time they add
        to the iteration that overlap does not hide (their union, minus every compute interval)."""
        compute = _union([(i.start_ms, i.end_ms) for i in self.intervals if i.activity in _COMPUTE])
        mine = _union([(i.start_ms, i.end_ms) for i in self.intervals if i.unit == unit and i.activity.is_collective])
        return _length(mine) - _length(_intersect(mine, compute))

    def work_beside_compute_ms(self, work_ms: Callable[[Interval], float]) -> float:
        """Of the collectives' processor work, how much falls while the rank computes: each
        collective's ``work_ms(interval)``, times the share of its interval that overlaps any
        compute (forward, backward, element-wise). Where a collective's work runs on the
        processor that computes (gloo on one core), that much delays the compute; the rest falls
        while the host waits, inside the collective's own time."""
        compute = _union([(i.start_ms, i.end_ms) for i in self.intervals if not i.activity.is_collective])
        total = 0.0
        for i in self.intervals:
            if i.activity.is_collective and i.duration_ms > 0:
                beside = _length(_intersect([(i.start_ms, i.end_ms)], compute))
                total += work_ms(i) * beside / i.duration_ms
        return total

    @property
    def limiting_link(self) -> Link | None:
        """The link whose collectives take the most of the critical path; None when compute alone
        makes it up."""
        on_path: dict[Link, float] = {}
        for index in self.critical:
            i = self.intervals[index]
            if i.link is not None:
                on_path[i.link] = on_path.get(i.link, 0.0) + i.duration_ms
        return max(on_path, key=lambda link: (on_path[link], link.value)) if on_path else None


_COMPUTE = (Activity.FORWARD, Activity.BACKWARD)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(max(x0, y0), min(x1, y1)) for x0, x1 in a for y0, y1 in b if min(x1, y1) > max(x0, y0)]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)
