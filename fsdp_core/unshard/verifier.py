"""Prove an all-gather schedule sound by simulating one recorded iteration, or list every reason not.

The checker walks ``request.events`` in order, asks the schedule for each hook's actions exactly as
the shell does (``UnshardSchedule.actions``, so on-demand fallbacks are checked too), and keeps for
every unit whether its flat parameter is sharded, in flight (all-gather issued, not awaited) or
gathered, whether its forward or backward is running, and whether it was gathered ahead of a use
that has not started yet. Every unit starts the iteration sharded. The post-backward plan's reshard
(``plan_reshards_unit``) is applied at each post-backward hook before the schedule's actions,
as FSDP1's ``_post_backward_reshard`` reshards before it prefetches.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import assert_never

from fsdp_core.problems import Problem, Rule
from fsdp_core.spec.events import Event, HookEvent
from fsdp_core.unshard.schedule import AwaitGather, Gather, Reshard, UnshardAction, UnshardSchedule

__all__ = ["check_unshard"]


class _Held(enum.Enum):
    SHARDED = "sharded"
    IN_FLIGHT = "in flight"
    GATHERED = "gathered"


_PRE = (Event.PRE_FORWARD, Event.PRE_BACKWARD)
_USE: Mapping[Event, str] = MappingProxyType({Event.PRE_FORWARD: "forward", Event.PRE_BACKWARD: "backward"})
"""What a pre-hook's unit starts running."""


@dataclass(slots=True)
class _Sim:
    schedule: UnshardSchedule
    held: list[_Held]
    problems: list[Problem] = field(default_factory=list)
    in_use: set[int] = field(default_factory=set)
    ahead: set[int] = field(default_factory=set)
    """Units gathered or in flight whose next use has not started since their all-gather was issued."""
    index: int = -1
    hook: HookEvent | None = None

    def report(self, rule: Rule, message: str) -> None:
        where = "" if self.hook is None else f"{self.hook.event.value} of unit {self.hook.unit}: "
        self.problems.append(Problem(rule=rule, op_index=self.index, message=where + message, site="event"))

    def run(self) -> list[Problem]:
        r = self.schedule.request
        for index, hook in enumerate(r.events):
            self.index, self.hook = index, hook
            self.fire(hook)
        self.index, self.hook = -1, None
        for unit, held in enumerate(self.held):
            if held is _Held.IN_FLIGHT:
                self.report(Rule.UNAWAITED_GATHER, f"unit {unit}'s all-gather is never awaited")
            elif unit in self.ahead:
                self.report(Rule.UNUSED_GATHER, f"unit {unit} is gathered but never used")
        return self.problems

    def fire(self, hook: HookEvent) -> None:
        r = self.schedule.request
        event, unit = hook
        if event not in _PRE:
            self.in_use.discard(unit)
        if event is Event.POST_BACKWARD and r.plan_reshards_unit(unit) and self.held[unit] is _Held.GATHERED:
            self.held[unit] = _Held.SHARDED
        for action in self.schedule.actions(event, unit):
            self.act(action)
        if event is Event.PRE_BACKWARD and not r.gathers_for_backward(unit):
            self.in_use.add(unit)  # its backward runs without its parameters
            self.ahead.discard(unit)
        elif event in _PRE:
            if self.held[unit] is not _Held.GATHERED:
                awaited = "its all-gather is not awaited" if self.held[unit] is _Held.IN_FLIGHT else "it is sharded"
                self.report(Rule.UNGATHERED_USE, f"unit {unit}'s {_USE[event]} runs but {awaited}")
            self.in_use.add(unit)
            self.ahead.discard(unit)
        if event is Event.POST_FORWARD:
            self.check_forward_reshard(unit)

    def act(self, action: UnshardAction) -> None:
        u = action.unit
        match action:
            case Gather():
                if self.held[u] is not _Held.SHARDED:
                    self.report(Rule.DOUBLE_GATHER, f"gathers unit {u}, which is already {self.held[u].value}")
                    return
                self.held[u] = _Held.IN_FLIGHT
                self.ahead.add(u)
                self.check_depth()
            case AwaitGather():
                if self.held[u] is _Held.SHARDED:
                    self.ahead.add(u)
                self.held[u] = _Held.GATHERED
                self.check_depth()
            case Reshard():
                if self.held[u] is not _Held.GATHERED:
                    self.report(Rule.UNSAFE_RESHARD, f"reshards unit {u}, which is {self.held[u].value}")
                elif u in self.in_use:
                    self.report(Rule.UNSAFE_RESHARD, f"reshards unit {u} while its forward or backward runs")
                elif u in self.ahead:
                    self.report(Rule.UNUSED_GATHER, f"reshards unit {u} before its all-gather was used")
                self.held[u] = _Held.SHARDED
                self.ahead.discard(u)
            case _:
                assert_never(action)

    def check_depth(self) -> None:
        assert self.hook is not None
        early = sorted(self.ahead - {self.hook.unit})
        depth = self.schedule.request.prefetch_depth
        if len(early) > depth:
            most = "one" if depth == 1 else str(depth)
            self.report(
                Rule.PREFETCH_DEPTH,
                f"units {', '.join(map(str, early))} are all gathered ahead of use; at most {most} may be",
            )

    def check_forward_reshard(self, unit: int) -> None:
        r = self.schedule.request
        should = r.reshards_after_forward(unit)
        if should and self.held[unit] is not _Held.SHARDED:
            self.report(
                Rule.FORWARD_RESHARD,
                f"unit {unit} keeps its unsharded parameter after forward; reshard_after_forward says to free it",
            )
        elif not should and self.held[unit] is not _Held.GATHERED:
            why = "it is the root" if unit == r.root and r.reshard_after_forward else "reshard_after_forward is off"
            self.report(
                Rule.FORWARD_RESHARD,
                f"unit {unit} is not gathered after forward, but {why}: backward would all-gather it again",
            )


def check_unshard(schedule: UnshardSchedule) -> list[Problem]:
    """Every problem in ``schedule``; an empty list means it is sound.

    Simulating the recorded iteration from every unit sharded (see ``UnshardRequest.events``):

    - ``UNGATHERED_USE``: when a unit's forward or backward starts (after its pre-hook's actions)
      its all-gather has landed and been awaited (not for a backward that does not gather it,
      ``request.gathers_for_backward``);
    - ``DOUBLE_GATHER``: no unit is gathered while already gathered or in flight;
    - ``UNSAFE_RESHARD``: no unit is resharded unless gathered and awaited, nor while its forward
      or backward runs;
    - ``PREFETCH_DEPTH``: at most one unit (or as many as the longest explicit prefetch list,
      ``request.prefetch_depth``) is gathered or in flight ahead of a use that has not started
      yet, besides the unit whose hook is running;
    - ``UNAWAITED_GATHER``: every all-gather issued is awaited by the end of the iteration;
    - ``UNUSED_GATHER``: every all-gather is used before its unit is resharded or the iteration
      ends;
    - ``FORWARD_RESHARD``: after its forward a unit is sharded exactly when
      ``request.reshards_after_forward(unit)`` (FSDP1: ``reshard_after_forward`` holds and it
      is not the root).

    Problems carry ``site="event"`` and the index of the hook in ``request.events``, or -1 for the
    end of the iteration.
    """
    r = schedule.request
    return _Sim(schedule=schedule, held=[_Held.SHARDED] * r.units).run()
