"""FSDP1's ``limit_all_gathers``: the host may not run more than two unsharded buffers ahead of
the device.

On an accelerator the host only enqueues work: freeing a unit's unsharded parameter returns at
once, but its memory is free only once the compute stream has run what was enqueued before the
free. Without a limit the host can issue all-gathers for several units ahead, each allocating a
new unsharded buffer while the old ones still wait to be freed. As in FSDP1, every free records
a marker on the compute stream (``Runtime.free_marker``), and before an all-gather is issued the
host waits for the oldest markers until at most one is outstanding: besides the buffers in use,
the device owes at most one free when a new buffer is allocated. On the CPU the host
runs the compute itself, so a free is done when it returns (``Runtime.frees_at_once``) and
there is nothing to limit: no limiter is made.
"""

from __future__ import annotations

from collections import deque

from fsdp_shell.runtime.collectives import Waitable
from fsdp_shell.runtime.protocol import Runtime

__all__ = ["GatherLimiter"]

MAX_PENDING_FREES = 2
"""FSDP1's ``_FreeEventQueue`` size: how many frees the device may still owe when a new
all-gather is issued."""


class GatherLimiter:
    """The rate limiter of one FSDP tree (``limit_all_gathers``)."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._frees: deque[Waitable] = deque()
        self.waits = 0
        """How many times the host has waited for a free before issuing an all-gather."""

    def before_gather(self) -> None:
        """Called before an all-gather that allocates an unsharded buffer is issued: while two
        or more frees are outstanding, wait for the oldest (FSDP1 waits for one only, so frees
        that pile up between gathers, at the end of a backward, stay owed)."""
        while len(self._frees) >= MAX_PENDING_FREES:
            self._frees.popleft().wait()
            self.waits += 1

    def freed(self) -> None:
        """Called after an unsharded buffer is freed."""
        self._frees.append(self._runtime.free_marker())
