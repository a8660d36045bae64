"""Run the all-gather side of FSDP from the core's verified schedule.

The first iteration runs on demand (each unit gathers right before it is used) and records the
order in which units run forward and in which their pre-backward hooks fire. At the end of that
backward the order becomes an ``UnshardRequest``; ``plan_unshard`` turns it into the schedule
(FSDP1's ``backward_prefetch`` / ``forward_prefetch``) and ``check_unshard`` proves it sound
once. From then on every hook runs the schedule's actions for its event and unit.

The actions run on the host thread inside the hooks, so every all-gather is issued in program
order, the same on every rank, interleaved with the reduce-scatters of the same group exactly as
the hooks fire.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import assert_never

from fsdp_core import (
    AwaitGather,
    BackwardPrefetch,
    Event,
    Gather,
    HookEvent,
    Reshard,
    ShardingStrategy,
    UnshardRequest,
    UnshardSchedule,
    check_unshard,
    plan_unshard,
    unshard_request,
)
from fsdp_shell.units.flat_param import FlatParamHandle

__all__ = ["UnshardRunner"]


class UnshardRunner:
    """The all-gather schedule of one FSDP tree: records the first iteration, then prefetches."""

    def __init__(
        self,
        handles: Sequence[FlatParamHandle | None],
        root: int,
        *,
        strategy: ShardingStrategy,
        low_precision: bool,
        backward_prefetch: BackwardPrefetch | None,
        forward_prefetch: bool,
    ) -> None:
        self._handles = handles
        self.reshards_after_backward = (strategy.reshards_after_backward(False), strategy.reshards_after_backward(True))
        """``strategy.reshards_after_backward(sync_gradients)``, indexed by ``sync_gradients``:
        whether the end of a backward frees what no plan resharded."""

        def request(forward: tuple[int, ...], backward: tuple[int, ...], sync_gradients: bool) -> UnshardRequest:
            return unshard_request(
                units=len(handles),
                root=root,
                forward_order=forward,
                backward_order=backward,
                strategy=strategy,
                low_precision=low_precision,
                sync_gradients=sync_gradients,
                backward_prefetch=backward_prefetch,
                forward_prefetch=forward_prefetch,
            )

        self._request = request
        self.schedule: UnshardSchedule = plan_unshard(request((), (), True))
        """On demand until the first iteration has been recorded; then the planned schedule."""
        self._recording = True
        self._forward: list[int] = []
        self._backward: list[int] = []

    def begin_forward(self) -> None:
        """The root's forward starts a new iteration."""
        if self._recording:
            self._forward.clear()
            self._backward.clear()

    def run(self, event: Event, unit: int) -> None:
        """Run the schedule's actions for ``event`` of ``unit`` (recording the order first)."""
        if self._recording and self._handles[unit] is not None:
            order: list[int] | None
            match event:
                case Event.PRE_FORWARD:
                    order = self._forward
                case Event.PRE_BACKWARD:
                    order = self._backward
                case Event.POST_FORWARD | Event.POST_BACKWARD | Event.END_FORWARD | Event.END_BACKWARD:
                    order = None
                case _:
                    assert_never(event)
            if order is not None and unit not in order:
                order.append(unit)
        for action in self.schedule.table[HookEvent(event, unit)]:  # every unit's every event is there
            handle = self._handles[action.unit]
            if handle is None:
                continue
            match action:
                case Gather():
                    handle.start_unshard()
                case AwaitGather():
                    handle.finish_unshard()
                case Reshard():
                    handle.free_unsharded()
                case _:
                    assert_never(action)

    def end_backward(self, *, sync_gradients: bool) -> None:
        """After the first complete iteration (``sync_gradients``: not inside ``no_sync``): plan
        and verify the schedule from its order."""
        if not self._recording or not self._forward or not self._backward:
            return
        schedule = plan_unshard(self._request(tuple(self._forward), tuple(self._backward), sync_gradients))
        problems = check_unshard(schedule)
        if problems:
            listed = "\n".join(f"  {p}" for p in problems)
            raise RuntimeError(f"the all-gather schedule planned from the first iteration is unsound:\n{listed}")
        self.schedule = schedule
        self._recording = False
