"""What one rank's runtime issues, collective by collective: counted by kind (op, group, dtype and
size, for as long as the process runs) and shown to whoever watches.

Nothing here grows with the number of steps: the counts have one entry per kind of collective,
and a record of each collective exists only while someone watches (``watching``), kept in the
watcher's own list. The demo counts its traffic from the totals; tests watch the issue order
(each group's sequence must be the same on every rank). Collectives are added by the host thread
and by the lane; within one group there is one issuer, so each group's sequence is its issue
order.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch

from fsdp_core import Group

__all__ = ["CollectiveKind", "CollectiveLog", "CollectiveRecord", "Phase"]


class Phase(enum.Enum):
    """Where a collective was issued, for the collective log."""

    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"
    LANE = "lane"
    END_OF_BACKWARD = "end_of_backward"
    OTHER = "other"


class CollectiveRecord(NamedTuple):
    """One collective issued by this rank."""

    op: str
    group: Group
    dtype: torch.dtype
    numel: int
    phase: Phase


class CollectiveKind(NamedTuple):
    """A kind of collective: what a rank counts them by."""

    op: str
    group: Group
    dtype: torch.dtype
    numel: int


class CollectiveLog:
    """The collectives this rank's runtime issues: ``counts`` by kind, and a ``CollectiveRecord``
    of each to every list ``watching`` has handed out.

    The host thread's collectives are recorded in the phase of the innermost ``during`` it is in
    (``OTHER`` outside any); those of the thread passed to ``mark_lane`` as ``LANE``."""

    def __init__(self) -> None:
        self.counts: dict[CollectiveKind, int] = {}
        self._watchers: tuple[list[CollectiveRecord], ...] = ()
        self._phase = Phase.OTHER
        self._lane: threading.Thread | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def during(self, phase: Phase) -> Iterator[None]:
        """Record the host thread's collectives inside as issued in ``phase``."""
        outer, self._phase = self._phase, phase
        try:
            yield
        finally:
            self._phase = outer

    @contextlib.contextmanager
    def watching(self) -> Iterator[list[CollectiveRecord]]:
        """A list that receives a record of every collective issued inside, in issue order per
        group (kept by the caller: nothing is kept here once the block ends)."""
        seen: list[CollectiveRecord] = []
        with self._lock:
            self._watchers = (*self._watchers, seen)
        try:
            yield seen
        finally:
            with self._lock:
                self._watchers = tuple(w for w in self._watchers if w is not seen)

    def mark_lane(self, thread: threading.Thread) -> None:
        """Collectives ``thread`` issues are the lane's."""
        self._lane = thread

    def add(self, op: str, group: Group, dtype: torch.dtype, numel: int) -> None:
        """Count a collective issued now, by the current thread, and show it to the watchers."""
        kind = CollectiveKind(op, group, dtype, numel)
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            watchers = self._watchers
        if watchers:
            on_lane = self._lane is not None and threading.current_thread() is self._lane
            record = CollectiveRecord(op, group, dtype, numel, Phase.LANE if on_lane else self._phase)
            for seen in watchers:
                seen.append(record)
