"""``fully_shard``'s all-gathers from the core's verified schedule, as FSDP1's are
(``fsdp_shell.units.unshard``).

Every iteration records the order in which the root's units run forward and in which their
pre-backward hooks fire. The schedule of an iteration is ``plan_unshard``'s for the orders of the
last complete iteration and the units' settings when the root's forward starts: each unit's
``reshard_after_forward`` (the root's own included), ``reshard_after_backward`` and
``set_unshard_in_backward``, and the explicit prefetch lists (``set_modules_to_forward_prefetch``,
``set_modules_to_backward_prefetch``). There is no implicit backward prefetch: on gloo it bought
no step time (the 4-block transformer of ``benchmarks/bench_training.py``: 0.96 of FSDP2's with
it, 0.95 without) and raised the HSDP backward peak above FSDP2's. Each distinct schedule is
proved sound by ``check_unshard`` once. Until an iteration has been recorded every hook gathers
on demand, and runs its unit's explicit lists, which need no record.

The actions run on the host thread inside the hooks, so every all-gather is issued in program
order, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, assert_never

from fsdp_core import (
    AwaitGather,
    Event,
    Gather,
    HookEvent,
    PerUnitGathers,
    Reshard,
    UnshardRequest,
    UnshardSchedule,
    check_unshard,
    per_param_unshard_request,
    plan_unshard,
)
from fsdp_shell.fsdp2.group import ParamGroup
from fsdp_shell.runtime.protocol import Runtime

__all__ = ["GatherRunner", "GatherUnit"]


class GatherUnit(Protocol):
    """What the runner reads of a ``fully_shard`` unit (``fsdp_shell.fsdp2.state.FSDPState``)."""

    @property
    def name(self) -> str: ...
    @property
    def group(self) -> ParamGroup | None: ...
    @property
    def runtime(self) -> Runtime | None: ...
    @property
    def post_forward_runtime(self) -> Runtime | None: ...
    @property
    def post_forward_size(self) -> int | None: ...
    @property
    def reshards_after_forward(self) -> bool: ...
    @property
    def reshards_after_backward(self) -> bool: ...
    @property
    def gathers_for_backward(self) -> bool: ...
    @property
    def forward_prefetches(self) -> tuple[GatherUnit, ...]: ...
    @property
    def backward_prefetches(self) -> tuple[GatherUnit, ...]: ...


class GatherRunner:
    """The all-gather schedule of one ``fully_shard`` root: its units are ``states``, in order."""

    def __init__(self, states: Sequence[GatherUnit], root: GatherUnit) -> None:
        self.states = states
        self._index = {id(s): i for i, s in enumerate(states)}
        self._root = self._index[id(root)]
        self._orders: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        """The forward and pre-backward orders of the last complete iteration."""
        self._forward: list[int] = []
        self._backward: list[int] = []
        self._verified: dict[UnshardRequest, UnshardSchedule] = {}
        self.schedule = self._schedule(self.request())
        """This iteration's schedule."""

    def request(self) -> UnshardRequest:
        """The schedule request of the next iteration: the recorded orders and every unit's
        settings now."""
        states = self.states
        gathers = PerUnitGathers(
            forward_reshards=tuple(s.reshards_after_forward for s in states),
            backward_reshards=tuple(s.reshards_after_backward for s in states),
            backward_gathers=tuple(s.gathers_for_backward for s in states),
            forward_prefetches=self._lists("set_modules_to_forward_prefetch", [s.forward_prefetches for s in states]),
            backward_prefetches=self._lists(
                "set_modules_to_backward_prefetch", [s.backward_prefetches for s in states]
            ),
        )
        return per_param_unshard_request(
            units=len(states),
            root=self._root,
            forward_order=self._orders[0],
            backward_order=self._orders[1],
            gathers=gathers,
        )

    def _lists(self, setter: str, lists: list[tuple[GatherUnit, ...]]) -> tuple[tuple[int, ...], ...]:
        out = []
        for owner, targets in zip(self.states, lists):
            for t in targets:
                if id(t) not in self._index:
                    raise ValueError(
                        f"{setter}: {t.name} is not under the root of {owner.name}; a unit prefetches units of "
                        "its own root"
                    )
            out.append(tuple(self._index[id(t)] for t in targets))
        return tuple(out) if any(out) else ()

    def _schedule(self, request: UnshardRequest) -> UnshardSchedule:
        schedule = self._verified.get(request)
        if schedule is None:
            schedule = plan_unshard(request)
            problems = check_unshard(schedule)
            if problems:  # pragma: no cover  (the planner's schedules are sound: tests/core)
                listed = "\n".join(f"  {p}" for p in problems)
                raise RuntimeError(f"the all-gather schedule planned for this iteration is unsound:\n{listed}")
            self._verified[request] = schedule
        return schedule

    def begin_iteration(self) -> None:
        """The root's forward starts an iteration: record afresh, plan from the settings now."""
        self._forward.clear()
        self._backward.clear()
        self.schedule = self._schedule(self.request())

    def run(self, event: Event, state: GatherUnit) -> None:
        """Run the schedule's actions for ``event`` of ``state``'s unit (recording it first)."""
        unit = self._index[id(state)]
        if state.group is not None:
            orders = {Event.PRE_FORWARD: self._forward, Event.PRE_BACKWARD: self._backward}
            order = orders.get(event)
            if order is not None and unit not in order:
                order.append(unit)
        for action in self.schedule.table[HookEvent(event, unit)]:
            target = self.states[action.unit]
            group, runtime = target.group, target.runtime
            if group is None or runtime is None:
                continue
            match action:
                case Gather():
                    group.start_unshard(runtime)
                case AwaitGather():
                    group.unshard(runtime)
                case Reshard():
                    size, small = target.post_forward_size, target.post_forward_runtime
                    if size is not None and small is not None:
                        group.reshard_post_forward(small, size)
                    else:
                        group.free_unsharded()
                    group.use_sharded()
                case _:
                    assert_never(action)

    def end_backward(self) -> None:
        """A backward ended: its iteration's orders are what the next one is planned from."""
        if self._forward and self._backward:
            self._orders = (tuple(self._forward), tuple(self._backward))
