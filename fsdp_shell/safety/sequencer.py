"""Ranks run the same FSDP events in the same order, even where their models take different paths.

Every collective FSDP issues belongs to an event of one unit: its pre-forward (the all-gather and
what the schedule prefetches), pre-backward (the all-gather), post-backward (the reduction), and
the ends of forward and backward. If one rank's forward skips a wrapped unit (a branch taken on
some ranks only), or a unit's gradient never arrives on one rank (its output unused there), the
ranks would issue different collectives and hang. So before each event the ranks agree on it
with one tiny all-gather: when they propose the same event, it runs; when they differ, every
rank runs the earliest proposed event (by the canonical order below) — for real if it is its
own, otherwise *virtually*: a pre-forward or pre-backward gathers and (forward) reshards at once,
a post-backward reduces a zero gradient. So every rank issues the same collectives in the same
order, and the unused unit contributes zero on the ranks that did not use it, as it does in a
single-process reference.

Canonical order: forward in construction order (children before their parent, the order their
modules are registered in), then the end of forward; backward: the root's pre-backward first,
then units in reverse forward order, each pre-backward before its post-backward, the root's
post-backward last, then the end of backward. A real gradient that arrives after its unit was
reduced with zeros (the ranks' orders really differed) is a ``RankMismatchError``, never a
silently dropped gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fsdp_core import Event, HookEvent
from fsdp_shell.runtime.collectives import all_gather_flat

__all__ = ["Sequencer"]


_CODES: tuple[Event, ...] = tuple(Event)
"""An event's number on the wire: its position in ``Event``."""


class Sequencer:
    """Agrees on each event with the other ranks of ``group`` (a CPU group)."""

    def __init__(self, group: dist.ProcessGroup | None, root: int) -> None:
        world = dist.group.WORLD
        assert isinstance(world, dist.ProcessGroup)
        self._group: dist.ProcessGroup = world if group is None else group
        self._root = root
        self._size = dist.get_world_size(group)
        self._local = torch.empty(2, dtype=torch.int64)
        self._gathered = torch.empty(2 * self._size, dtype=torch.int64)
        self.calls = 0
        """How many agreements ran (collectives issued)."""

    def _key(self, e: HookEvent) -> tuple[float, ...]:
        if e.event is Event.PRE_FORWARD:
            return (0.0, float(e.unit))
        if e.event is Event.END_FORWARD:
            return (0.0, math.inf)
        if e.event is Event.END_BACKWARD:
            return (1.0, math.inf)
        if e.unit == self._root:
            return (1.0, -math.inf if e.event is Event.PRE_BACKWARD else math.inf - 1)
        return (1.0, float(-e.unit), float(e.event is Event.POST_BACKWARD))

    def agree(self, mine: HookEvent) -> HookEvent:
        """The event every rank runs next: ``mine`` if every rank proposes it, else the earliest
        proposed (a collective)."""
        if self._size == 1:
            return mine
        self._local[0], self._local[1] = _CODES.index(mine.event), mine.unit
        all_gather_flat(self._gathered, self._local, self._group)
        proposals = {HookEvent(_CODES[k], u) for k, u in self._gathered.view(-1, 2).tolist()}
        self.calls += 1
        if len(proposals) == 1:
            return mine
        return min(proposals, key=self._key)
