"""What the all-gather schedule holds, hook by hook: exact bytes from the schedule's actions.

A flat parameter's unit is gathered into memory of its own (``GatherBytes.unsharded``: the padded
flat parameter in the compute dtype) unless the unsharded parameter is the local shard itself
(``NO_SHARD`` in the parameters' own dtype). Nothing else: a shard in a compute dtype of its own
is cast into its own slot of that memory and gathered in place (``NO_SHARD`` casts into it).

A per-parameter (``fully_shard``) unit is gathered into a buffer of the all-gather's own
(``GatherBytes.buffer``: the layout's ``padded_numel`` in the compute dtype), allocated when the
all-gather is issued, the shards copied into this rank's slice of it; where its result is awaited,
the unsharded parameters' memory comes back (``unsharded``: every parameter's stacked chunks,
and for a parameter sharded on another dimension its whole tensor too), the buffer is copied
out into it (a parameter on another dimension through a concatenation of its chunks, the
largest of which is ``copy_out``) and returned (``per_param_gather_bytes``).

``unshard_footprints`` walks one iteration's hook events in order (``UnshardRequest.events``),
each unit sharded, in flight or gathered, and gives each event's peak and net bytes, relative to
just before it, as the shell's ``UnshardRunner`` runs them. A unit's post-backward plan reshards
it before its post-backward actions run (``PlanMemory.unsharded`` counts those bytes); at the end
of backward the units still gathered are resharded unless the strategy keeps them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

import torch

from fsdp_core.memory.allocator import EXACT, Allocator
from fsdp_core.memory.plan_memory import unsharded_param_bytes
from fsdp_core.plan.request import PlanRequest
from fsdp_core.spec.events import Event, HookEvent
from fsdp_core.spec.per_param import PerParamLayout
from fsdp_core.unshard.schedule import AwaitGather, Gather, Reshard, UnshardAction, UnshardSchedule

__all__ = [
    "GatherBytes",
    "GatherWalk",
    "UnshardFootprint",
    "gather_bytes",
    "per_param_gather_bytes",
    "unshard_footprints",
]


@dataclass(frozen=True, slots=True)
class GatherBytes:
    """One unit's all-gather memory (module docstring)."""

    unsharded: int
    buffer: int = 0
    """A per-parameter unit's all-gather buffer, held from the issue to the copy-out (0: the unit
    gathers into its unsharded memory itself, a flat parameter)."""
    copy_out: int = 0
    """A per-parameter unit's largest temporary of the copy-out."""
    post_forward: int = 0
    """A per-parameter unit that reshards to a smaller group after forward (``fully_shard``'s
    ``reshard_after_forward`` an int, ZeRO++'s hpZ): the part of its gathered chunks its
    ``Reshard`` keeps, made before the unsharded memory goes and given back when the next
    all-gather has copied it into its buffer (0: a ``Reshard`` frees everything)."""


def gather_bytes(request: PlanRequest, allocator: Allocator = EXACT) -> GatherBytes:
    """``request``'s unit as the runtimes gather it (a flat parameter)."""
    return GatherBytes(unsharded_param_bytes(request, allocator))


def per_param_gather_bytes(
    layout: PerParamLayout, compute: torch.dtype, allocator: Allocator = EXACT, *, post_forward_ranks: int = 0
) -> GatherBytes:
    """A per-parameter unit with every parameter ``layout`` holds (those without gradients
    too) gathered in ``compute`` (module docstring); ``post_forward_ranks``: the size of the
    groups it reshards to after forward (0: none)."""
    size = compute.itemsize
    buffer = allocator.size(layout.padded_numel * size)
    stacked = [allocator.size(math.prod(layout.gathered_shape(i)) * size) for i in range(len(layout.params))]
    wholes = [allocator.size(math.prod(p.shape) * size) for p in layout.params if p.shard_dim != 0]
    part = allocator.size(layout.padded_numel // post_forward_ranks * size) if post_forward_ranks else 0
    return GatherBytes(sum(stacked) + sum(wholes), buffer=buffer, copy_out=max(wholes, default=0), post_forward=part)


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
            walk.resharded(unit)
    return tuple(out)


class GatherWalk:
    """Every unit's unsharded parameter as the shell's ``UnshardRunner`` and ``FlatParamHandle``
    hold it, one action at a time, from every unit sharded: ``live`` is the bytes they hold now,
    ``peak`` the highest since the last ``run_all``'s start (or since construction)."""

    def __init__(self, units: Sequence[GatherBytes]) -> None:
        self.units = units
        self.state = [_State.SHARDED] * len(units)
        self.parts = [False] * len(units)
        """Per unit: whether it holds the part a reshard to a smaller group kept."""
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
        u = self.units[unit]
        self._add(u.buffer or u.unsharded)
        if self.parts[unit]:  # copied into the buffer, then given back
            self.live -= u.post_forward
            self.parts[unit] = False
        self.state[unit] = _State.IN_FLIGHT

    def _finish(self, unit: int) -> None:
        self._start(unit)
        u = self.units[unit]
        if self.state[unit] is _State.IN_FLIGHT and u.buffer:  # unsharded memory back, the copy-out, the buffer gone
            self._add(u.unsharded)
            self.peak = max(self.peak, self.live + u.copy_out)
            self.live -= u.buffer
        self.state[unit] = _State.UNSHARDED

    def resharded(self, unit: int) -> None:
        """Freed outside the schedule (by the unit's post-backward plan, at the end of backward),
        a part kept for a smaller group's gather too."""
        u = self.units[unit]
        if self.parts[unit]:
            self.live -= u.post_forward
            self.parts[unit] = False
        if self.state[unit] is _State.IN_FLIGHT and u.buffer:  # an all-gather no one waited for: its buffer back
            self.live -= u.buffer
            self.state[unit] = _State.SHARDED
            return
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
                u = self.units[action.unit]
                if u.post_forward and self.state[action.unit] is _State.UNSHARDED:
                    self._add(u.post_forward)  # the part is made while the unsharded memory is held
                    self.live -= u.unsharded
                    self.state[action.unit] = _State.SHARDED
                    self.parts[action.unit] = True
                else:
                    self.resharded(action.unit)
            case _:
                assert_never(action)
