"""Shorthand for the all-gather schedule's tests (``test_unshard_*.py``): ``g``, ``a`` and ``r``
for a unit's gather, await and reshard; ``chain`` for the record of a chain of nested units (root
0 wrapping the others, forward in order, backward from the last); ``rows`` for a schedule as
(event, unit, actions) rows.
"""

from __future__ import annotations

from fsdp_core import (
    AwaitGather,
    BackwardPrefetch,
    Event,
    Gather,
    Reshard,
    UnshardAction,
    UnshardRequest,
    UnshardSchedule,
)

E = Event
PRE, POST = BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST


def g(u: int) -> Gather:
    return Gather(unit=u)


def a(u: int) -> AwaitGather:
    return AwaitGather(unit=u)


def r(u: int) -> Reshard:
    return Reshard(unit=u)


Row = tuple[Event, int, tuple[UnshardAction, ...]]


def chain(
    raf: bool = True,
    rab: bool = True,
    prefetch: BackwardPrefetch | None = PRE,
    forward_prefetch: bool = False,
    units: int = 4,
) -> UnshardRequest:
    return UnshardRequest.chain(
        units,
        reshard_after_forward=raf,
        plan_reshards=rab,
        backward_prefetch=prefetch,
        forward_prefetch=forward_prefetch,
    )


def rows(schedule: UnshardSchedule) -> list[Row]:
    return [(s.event, s.unit, s.actions) for s in schedule.steps]
