"""The log of every collective one rank's runtime issues: op, group, dtype, size and where.

Tests compare it across ranks (each group's sequence must be the same on every rank) and the
demo counts its traffic. Records are appended by the host thread and by the lane; within one
group there is one issuer, so each group's sequence is its issue order.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch

from fsdp_core import Group

__all__ = ["CollectiveLog", "CollectiveRecord", "Phase"]


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


class CollectiveLog:
    """Every collective this rank's runtime issued, in issue order per group.

    The host thread's collectives are logged in the phase of the innermost ``during`` it is in
    (``OTHER`` outside any); those of the thread passed to ``mark_lane`` as ``LANE``."""

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []
        self._phase = Phase.OTHER
        self._lane: threading.Thread | None = None

    @contextlib.contextmanager
    def during(self, phase: Phase) -> Iterator[None]:
        """Log the host thread's collectives inside as issued in ``phase``."""
        outer, self._phase = self._phase, phase
        try:
            yield
        finally:
            self._phase = outer

    def mark_lane(self, thread: threading.Thread) -> None:
        """Collectives ``thread`` issues are the lane's."""
        self._lane = thread

    def add(self, op: str, group: Group, dtype: torch.dtype, numel: int) -> None:
        """Log a collective issued now, by the current thread."""
        on_lane = self._lane is not None and threading.current_thread() is self._lane
        self.records.append(CollectiveRecord(op, group, dtype, numel, Phase.LANE if on_lane else self._phase))

    def of_group(self, group: Group) -> list[CollectiveRecord]:
        """The records of one group, in the order they were issued."""
        return [r for r in self.records if r.group is group]
