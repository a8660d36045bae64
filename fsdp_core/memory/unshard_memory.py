"""What the all-gather schedule holds, hook by hook: exact bytes from the schedule's actions.

A unit's parameters are gathered into memory of their own (``GatherBytes.unsharded``: the padded
flat parameter in the compute dtype) unless the unsharded parameter is the local shard itself
(``NO_SHARD`` in the parameters' own dtype). Nothing else: a shard in a compute dtype of its own
is cast into its own slot of that memory and gathered in place (``NO_SHARD`` casts into it).

``unshard_footprints`` walks one iteration's hook events in order (``UnshardRequest.events``),
each unit sharded, in flight or gathered, and gives each event's peak and net bytes, relative to
just before it, as the shell's ``UnshardRunner`` runs them. A unit's post-backward plan reshards
it before its post-backward actions run (``PlanMemory.unsharded`` counts those bytes); at the end
of backward the units still gathered are resharded unless the strategy keeps them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from fsdp_core.memory.allocator import EXACT, Allocator
from fsdp_core.memory.plan_memory import unsharded_param_bytes
from fsdp_core.plan.request import PlanRequest
from fsdp_core.spec.events import Event, HookEvent
from fsdp_core.unshard.schedule import AwaitGather, Gather, Reshard, UnshardAction, UnshardSchedule

__all__ = [
    "GatherBytes",
    "GatherWalk",
    "UnshardFootprint",
    "gather_bytes",
    "unshard_footprints",
]


@dataclass(frozen=True, slots=True)
class GatherBytes:
    """One unit's all-gather memory (module docstring)."""

    unsharded: int


def gather_bytes(request: PlanRequest, allocator: Allocator = EXACT) -> GatherBytes:
    """``request``'s unit as the runtimes gather it."""
    return GatherBytes(unsharded_param_bytes(request, allocator))


class _State(enum.Enum):
    SHARDED = "sharded"
    IN_FLIGHT = "in_flight"
    UNSHARDED = "unsharded"


@dataclass(frozen=True, slots=True)
class UnshardFootprint:
    """One hook event's all-gather actions: the highest and the net bytes from just before."""

    event: HookEvent
    peak: int
    net: int


def unshard_footprints(
    schedule: UnshardSchedule, units: Sequence[GatherBytes], plans_reshard: Sequence[bool]
) -> tuple[UnshardFootprint, ...]:
    """Every hook event of one iteration, in order, with what its actions hold. ``units[u]``:
    unit ``u``'s gather bytes (``gather_bytes``); ``plans_reshard[u]``: whether its
    post-backward plan frees its unsharded parameter (``Plan.should_free_in_backward``). Starts
    with every unit sharded."""
    walk = GatherWalk(units)
    out: list[UnshardFootprint] = []
    for event in schedule.request.events:
        if event.event is Event.POST_BACKWARD and plans_reshard[event.unit]:
            walk.resharded(event.unit)
        peak, net = walk.run_all(schedule.actions(event.event, event.unit))
        out.append(UnshardFootprint(event, peak, net))
    for unit in range(len(units)):
        if schedule.request.reshards_at_end_of_backward(unit):
            walk.run(Reshard(unit=unit))
    return tuple(out)


class GatherWalk:
    """Every unit's unsharded parameter as the shell's ``UnshardRunner`` and ``FlatParamHandle``
    hold it, one action at a time, from every unit sharded: ``live`` is the bytes they hold now,
    ``peak`` the highest since the last ``run_all``'s start (or since construction)."""

    def __init__(self, units: Sequence[GatherBytes]) -> None:
        self.units = units
        self.state = [_State.SHARDED] * len(units)
        self.live = 0
        self.peak = 0

    def run_all(self, actions: Sequence[UnshardAction]) -> tuple[int, int]:
        """Run ``actions`` in order; their peak and net bytes, relative to just before."""
        start = self.peak = self.live
        for action in actions:
            self.run(action)
        return self.peak - start, self.live - start

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _start(self, unit: int) -> None:
        if self.state[unit] is not _State.SHARDED:
            return
        self._add(self.units[unit].unsharded)
        self.state[unit] = _State.IN_FLIGHT

    def _finish(self, unit: int) -> None:
        self._start(unit)
        self.state[unit] = _State.UNSHARDED

    def resharded(self, unit: int) -> None:
        """Freed outside the schedule (by the unit's post-backward plan)."""
        if self.state[unit] is not _State.SHARDED:
            self._finish(unit)
            self.live -= self.units[unit].unsharded
            self.state[unit] = _State.SHARDED

    def run(self, action: UnshardAction) -> None:
        match action:
            case Gather():
                self._start(action.unit)
            case AwaitGather():
                self._finish(action.unit)
            case Reshard():
                self.resharded(action.unit)
            case _:
                assert_never(action)
