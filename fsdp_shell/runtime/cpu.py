"""Where a plan's ops run: CUDA streams, or the host thread and one lane thread on the CPU.

- ``CudaRuntime``: every op is enqueued from the hook on the CUDA stream its plan stream maps
  to; waits are ``wait_stream``, ``record_stream`` tells the caching allocator.
- ``CpuRuntime``: there is no device queue, so an op runs on the host thread that reaches it,
  unless it must wait for an asynchronous collective: then it is deferred to the ``Lane``, one
  FIFO worker thread that waits for the collective (``Work.wait()``) and then runs what depends
  on it, while the hook returns and autograd goes on.

Every process group has exactly one issuer, so collectives are issued in the same order on
every rank whatever the timing: the host thread inside the hooks for the shard group (and the
all-gathers), the lane for the replicate group. Nothing polls for completion.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from typing import Callable, Mapping, Protocol

import torch

from fsdp_core import Group, Stream
from fsdp_shell.runtime.log import CollectiveLog

__all__ = ["CpuRuntime", "CudaRuntime", "Lane", "Runtime", "Waiter"]

Waiter = Callable[[], None]
"""Blocks until an issued collective's result is in place (on CUDA: makes the stream wait)."""


class Lane:
    """One FIFO worker thread that runs, in submission order, CPU work waiting for collectives.

    ``submit`` returns a ticket; ``wait_for(ticket)`` blocks until that work is done. ``drain``
    blocks until everything submitted has run and re-raises the first failure; after a failure
    the rest of the queue is skipped, so nothing runs on a half-reduced gradient."""

    def __init__(self, log: CollectiveLog) -> None:
        self._queue: queue.Queue[Callable[[], object]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._log = log
        self._submitted = 0
        self._done = 0
        self._progress = threading.Condition()

    def submit(self, work: Callable[[], object]) -> int:
        """Run ``work`` on the lane after everything submitted before it; returns its ticket."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="fsdp-lane", daemon=True)
            self._log._lane_thread = self._thread
            self._thread.start()
        self._submitted += 1
        self._queue.put(work)
        return self._submitted

    def done(self, ticket: int) -> bool:
        """Whether the work with ``ticket`` has run (or been skipped after a failure)."""
        return self._done >= ticket

    def wait_for(self, ticket: int) -> None:
        """Block until the work with ``ticket`` has run (or been skipped after a failure)."""
        with self._progress:
            self._progress.wait_for(lambda: self._done >= ticket)

    def _serve(self) -> None:
        while True:
            work = self._queue.get()
            try:
                if self._error is None:
                    work()
            except BaseException as error:  # noqa: BLE001  (re-raised on the host thread by drain)
                self._error = error
            finally:
                del work
                with self._progress:
                    self._done += 1
                    self._progress.notify_all()
                self._queue.task_done()

    def drain(self) -> None:
        """Block until the lane is empty; raise what failed on it since the last drain."""
        self._queue.join()
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"a post-backward op deferred to the lane failed: {error}") from error


class Runtime(Protocol):
    """Where a plan's ops run: CUDA streams, or the host thread and the lane."""

    def allocating(self, stream: Stream) -> contextlib.AbstractContextManager[object]:
        """Allocate under ``stream`` (so the caching allocator attributes the block to it)."""

    def compute(self, stream: Stream, deferred: bool, work: Callable[[], object]) -> bool:
        """Run element-wise ``work`` in ``stream``'s order (``deferred``: after pending
        collectives); returns whether it was deferred (its operands pending afterwards)."""

    def collective(self, stream: Stream, group: Group, operands_pending: bool,
                   issue: Callable[[], Waiter | None]) -> bool:
        """Issue a collective through ``group``'s one issuer; returns whether its operands are
        pending afterwards (its result not yet in place)."""

    def wait_stream(self, stream: Stream, waits_for: Stream) -> None:
        """``stream`` waits for the work enqueued on ``waits_for`` so far."""

    def end_of_backward(self, stream: Stream, waits_for: Stream) -> None:
        """At the end of backward: ``stream`` (and the host, where results go to the host) waits
        for everything on ``waits_for``."""

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``tensor`` is in use on ``stream`` (caching allocator bookkeeping)."""

    def drain(self) -> None:
        """Block until all work issued so far has completed."""

    def after_host_copy(self, stream: Stream) -> None:
        """A non-blocking device-to-host copy was enqueued on ``stream``; the end of backward
        must wait for it on the host."""


class CpuRuntime:
    """Ops run on the host thread when ready, on the lane when they must wait.

    An op goes to the lane when it touches an operand a collective has not produced yet, or
    when its stream already has work on the lane (stream order, as on a CUDA stream: with
    ``hybrid_all_reduce="sync"`` the next unit's reduce-scatter waits behind this unit's
    all-reduce on the post-backward stream). A collective goes to the lane only if its group
    is in ``lane_may_issue``: the replicate group always; the shard group only when the
    all-gathers have a group of their own, so the host issues nothing else on it. Otherwise the
    host first waits for the lane to catch up, then issues it itself. Either way each group's
    collectives are issued one after another by one thread at a time, in program order.

    At most ``max_in_flight`` collectives issued by the host thread are outstanding: before
    issuing another, the hook waits for the oldest to land. The default, 0, lands each one
    inside its own hook: a shard-group reduction still in flight holds a unit's unsharded
    gradient while the next unit's backward allocates its own, which on a CPU with no device
    of its own buys no speed on gloo and costs that much peak memory over FSDP1 (measured by
    ``benchmarks/bench_training.py``: +25-35 MiB, +25%, on 8 units of 2048 x 2048 with 1; equal
    with 0). The replicate all-reduce, the slow inter-node one, is issued by the lane and
    overlaps later backward work either way."""

    LANE_GROUPS = frozenset({Group.REPLICATE})
    """Groups whose collectives the lane issues (all of them, always): the replicate
    all-reduce reads a reduce-scatter's result, so only the lane can issue it without blocking."""

    def __init__(self, log: CollectiveLog, max_in_flight: int = 0,
                 lane_may_issue: frozenset[Group] = LANE_GROUPS) -> None:
        self.lane = Lane(log)
        self.max_in_flight = max_in_flight
        self.lane_may_issue = lane_may_issue | self.LANE_GROUPS
        self._in_flight: collections.deque[int] = collections.deque()
        self._tail: dict[Stream | Group, int] = {}

    def _busy(self, *keys: Stream | Group) -> bool:
        return any(not self.lane.done(self._tail.get(k, 0)) for k in keys)

    def _enqueue(self, work: Callable[[], object], *keys: Stream | Group) -> int:
        ticket = self.lane.submit(work)
        for key in keys:
            self._tail[key] = ticket
        return ticket

    def allocating(self, stream: Stream) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def compute(self, stream: Stream, deferred: bool, work: Callable[[], object]) -> bool:
        if deferred or self._busy(stream):
            self._enqueue(work, stream)
            return True
        work()
        return False

    def collective(self, stream: Stream, group: Group, operands_pending: bool,
                   issue: Callable[[], Waiter | None]) -> bool:
        behind = operands_pending or self._busy(stream, group)
        if group in self.LANE_GROUPS or (behind and group in self.lane_may_issue):
            self._enqueue(lambda: _issue_and_wait(issue), stream, group)
            return True
        if behind:
            self.drain()
        while self._in_flight and len(self._in_flight) >= self.max_in_flight:
            self.lane.wait_for(self._in_flight.popleft())
        waiter = issue()
        if waiter is None:
            return False
        if self.max_in_flight == 0:
            waiter()
            return False
        self._in_flight.append(self._enqueue(waiter, stream, group))
        return True

    def wait_stream(self, stream: Stream, waits_for: Stream) -> None:
        return None

    def end_of_backward(self, stream: Stream, waits_for: Stream) -> None:
        self.drain()

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        return None

    def drain(self) -> None:
        self._in_flight.clear()
        self._tail.clear()
        self.lane.drain()

    def after_host_copy(self, stream: Stream) -> None:
        return None


def _issue_and_wait(issue: Callable[[], Waiter | None]) -> None:
    waiter = issue()
    if waiter is not None:
        waiter()


class CudaRuntime:
    """Every op enqueued from the hook on its plan stream's CUDA stream."""

    def __init__(self, streams: Mapping[Stream, torch.cuda.Stream]) -> None:
        self.streams = streams
        self._host_copies: list[torch.cuda.Event] = []

    def allocating(self, stream: Stream) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(self.streams[stream])

    def compute(self, stream: Stream, deferred: bool, work: Callable[[], object]) -> bool:
        with torch.cuda.stream(self.streams[stream]):
            work()
        return False

    def collective(self, stream: Stream, group: Group, operands_pending: bool,
                   issue: Callable[[], Waiter | None]) -> bool:
        with torch.cuda.stream(self.streams[stream]):
            _issue_and_wait(issue)
        return False

    def wait_stream(self, stream: Stream, waits_for: Stream) -> None:
        self.streams[stream].wait_stream(self.streams[waits_for])

    def end_of_backward(self, stream: Stream, waits_for: Stream) -> None:
        self.wait_stream(stream, waits_for)
        copies, self._host_copies = self._host_copies, []
        for event in copies:
            event.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        if tensor.is_cuda:
            tensor.record_stream(self.streams[stream])

    def drain(self) -> None:
        for s in self.streams.values():
            s.synchronize()

    def after_host_copy(self, stream: Stream) -> None:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        event.record(self.streams[stream])
        self._host_copies.append(event)
