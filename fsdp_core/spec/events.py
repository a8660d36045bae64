"""The hooks of one FSDP iteration, the one vocabulary for what happens when.

Every collective FSDP issues belongs to one of these events: the all-gather schedule says what to
gather, await and reshard at each (``fsdp_core.unshard``), the shell's hooks fire them, the ranks
agree on them when their paths may diverge, and the simulator replays them.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["Event", "HookEvent"]


class Event(enum.Enum):
    """One hook of an FSDP iteration."""

    PRE_FORWARD = "pre_forward"
    """Before a unit's forward: its parameters must be gathered when the schedule's actions return."""
    POST_FORWARD = "post_forward"
    """After a unit's forward."""
    END_FORWARD = "end_forward"
    """The root's forward has returned (no unit: ``HookEvent.unit`` is -1)."""
    PRE_BACKWARD = "pre_backward"
    """A unit's pre-backward hook (on its forward outputs): its parameters must be gathered when the
    schedule's actions return."""
    POST_BACKWARD = "post_backward"
    """A unit's post-backward hook, after the post-backward plan's hook ops (which reshard when
    ``reshard_after_backward``)."""
    END_BACKWARD = "end_backward"
    """The end-of-backward callback (no unit: ``HookEvent.unit`` is -1)."""


class HookEvent(NamedTuple):
    """One hook firing: ``event`` for ``unit`` (-1 for the ends of forward and backward)."""

    event: Event
    unit: int
