"""The CPU runtime: plan ops on the host thread when their operands are ready, on one lane thread
when they must wait for a collective.

Where each op runs and when a freed buffer's memory returns is decided by
``fsdp_core.execution.lane.LaneOrder`` (its docstring has the rules), which the memory model and
the simulator fold over too; this module carries the decisions out: the ``Lane`` thread waits
for a collective (``Work.wait()``) and runs what depends on it while the hook returns and
autograd goes on. Every process group has exactly one issuer, so collectives are issued in the
same order on every rank whatever the timing. Nothing polls for completion.

A buffer a collective used is freed by shrinking its storage when its memory returns, since
gloo's threads may still hold a reference to it for a moment after ``wait()`` returns
(``LiveBytes`` saw one in four all-gather inputs outlive the wait). The forms gloo's collectives
take are ``fsdp_core.execution.lane``'s.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from fsdp_core import Group, ReduceOpSpec, Stream
from fsdp_core.execution import LaneOrder, Place, ScatterForm, gather_by_broadcasts, gather_waits, scatter_form
from fsdp_shell.runtime.collectives import (
    CollectiveLog,
    Pending,
    Waitable,
    all_gather_flat,
    broadcast_gather,
    completed,
    reduce_scatter_flat,
    release,
    to_reduce_op,
)
from fsdp_shell.runtime.groups import ProcessGroups

__all__ = ["CpuRuntime", "Lane", "gloo_reduce_scatter"]


class _Reached:
    """A marker the host has passed already: the CPU runs the compute on the host thread."""

    def wait(self) -> None:
        return None


_REACHED = _Reached()


class Lane:
    """One FIFO worker thread that runs, in submission order, CPU work waiting for collectives.

    ``submit`` returns a ticket; ``wait_through(ticket)`` blocks until that work has run. ``drain``
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

    @property
    def submitted(self) -> int:
        """The ticket of the last work submitted (0: none yet)."""
        return self._submitted

    def submit(self, work: Callable[[], object]) -> int:
        """Run ``work`` on the lane after everything submitted before it; returns its ticket."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="fsdp-lane", daemon=True)
            self._log.mark_lane(self._thread)
            self._thread.start()
        self._submitted += 1
        self._queue.put(work)
        return self._submitted

    def wait_through(self, ticket: int) -> None:
        """Block until the work with ``ticket`` and everything before it has run (or been
        skipped); what failed is raised by ``drain``."""
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


class CpuRuntime:
    """Ops run on the host thread when ready, on the lane when they must wait: each decision is
    ``fsdp_core.execution.lane.LaneOrder``'s (which the memory model and the simulator fold over
    too); this class carries them out on tensors, one lane thread and process groups."""

    frees_at_once = True

    def __init__(self, groups: ProcessGroups, log: CollectiveLog, *, lane_issues_shard: bool = False) -> None:
        self.lane = Lane(log)
        self._groups = groups
        self._by_group = {g: groups.of(g) for g in Group if g is Group.SHARD or groups.replicate is not None}
        """The process group of each plan group there is (``ProcessGroups.of``, asked once)."""
        self._log = log
        self._gloo = groups.backend == "gloo"
        self.order: LaneOrder[torch.Tensor] = LaneOrder(lane_issues_shard=lane_issues_shard)
        """The placement decisions, over tensors by ``id`` (a tensor cannot be freed, and its
        ``id`` reused, while lane work that uses it has not run: the work holds it)."""
        self._collective_operands: set[int] = set()
        """By ``id``: tensors a collective has read or written since the last drain."""

    @property
    def lane_issues_shard(self) -> bool:
        return self.order.lane_issues_shard

    # -- carrying out the decisions ------------------------------------------------------------

    def _run(self, place: Place, work: Callable[[], object]) -> None:
        if place is Place.LANE:
            ticket = self.lane.submit(work)
            assert ticket == self.order.submitted, "the lane and its order disagree"
            return
        if place is Place.HOST_AFTER_DRAIN:
            self.drain()
        work()

    def _collective(
        self,
        stream: Stream,
        group: Group,
        issue: Callable[[], object],
        uses: tuple[torch.Tensor, ...],
        announce: Callable[[], None],
    ) -> None:
        """Place a collective and, where placed, issue it (``announce`` logs it on the issuing
        thread) and wait until it has ``completed``."""
        self._collective_operands.update(id(t) for t in uses)
        place = self.order.collective(stream, group, tuple(id(t) for t in uses))
        self._run(place, partial(completed, issue, uses, announce))

    def _release(self, tensor: torch.Tensor) -> None:
        """Return ``tensor``'s memory now: a collective's operand by shrinking its storage (gloo may
        still hold the tensor for a moment), when the tensor is all of it."""
        if id(tensor) in self._collective_operands:
            self._collective_operands.discard(id(tensor))
            if tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes:
                release(tensor)

    # -- the Runtime protocol ------------------------------------------------------------------

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device, stream: Stream) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def free(self, tensor: torch.Tensor) -> None:
        if self.order.free(id(tensor), tensor):
            self._release(tensor)

    def begin_plan(self) -> None:
        ticket = self.order.begin_plan()
        if ticket > self.order.waited:
            self.lane.wait_through(ticket)
            for t in self.order.waited_through(ticket):
                self._release(t)

    def compute(self, stream: Stream, work: Callable[[], object], uses: tuple[torch.Tensor, ...]) -> None:
        self._run(self.order.compute(stream, tuple(id(t) for t in uses)), work)

    def on_host(self, work: Callable[[], None], uses: tuple[torch.Tensor, ...]) -> None:
        self._run(self.order.on_host(tuple(id(t) for t in uses)), work)

    def user_hook(self, stream: Stream, work: Callable[[], None], uses: tuple[torch.Tensor, ...]) -> None:
        self.on_host(work, uses)

    def reduce_scatter(
        self, stream: Stream, group: Group, dst: torch.Tensor, src: torch.Tensor, op: ReduceOpSpec, *, src_dies: bool
    ) -> None:
        pg = self._by_group.get(group) or self._groups.of(group)  # ``of`` says why a group is missing
        form = scatter_form(
            op.kind, src.numel() * src.element_size(), gloo=self._gloo, src_dies=src_dies, ranks=pg.size()
        )
        announce = partial(self._log.add, "reduce_scatter", group, src.dtype, src.numel())
        if form is ScatterForm.LOCAL:
            self._collective(stream, group, partial(_copied, dst, src), (src, dst), announce)
            return
        if form is ScatterForm.NATIVE:
            native = partial(reduce_scatter_flat, dst, src, pg, to_reduce_op(op), async_op=True)
            self._collective(stream, group, native, (src, dst), announce)
            return
        chunks = torch.empty_like(src) if form.receive_buffer else None
        on_gloo = partial(gloo_reduce_scatter, dst, src, pg, chunks)
        self._collective(stream, group, on_gloo, (src, dst) if chunks is None else (src, dst, chunks), announce)
        if chunks is not None:
            self.free(chunks)

    def all_reduce(self, stream: Stream, group: Group, tensor: torch.Tensor, op: ReduceOpSpec) -> None:
        pg = self._by_group.get(group) or self._groups.of(group)
        issue = partial(dist.all_reduce, tensor, op=to_reduce_op(op), group=pg, async_op=True)
        self._collective(
            stream, group, issue, (tensor,), partial(self._log.add, "all_reduce", group, tensor.dtype, tensor.numel())
        )

    def comm_hook(
        self,
        stream: Stream,
        group: Group,
        call: Callable[[], None],
        src: torch.Tensor,
        out: torch.Tensor,
        wire_dtype: torch.dtype,
    ) -> None:
        self._collective(
            stream, group, call, (src, out), partial(self._log.add, "comm_hook", group, wire_dtype, src.numel())
        )

    def to_host(self, stream: Stream, src: torch.Tensor, buffer: Callable[[], torch.Tensor]) -> torch.Tensor:
        if src.device.type == "cpu":
            return src
        dst = buffer()
        self.compute(stream, lambda: dst.copy_(src), (src, dst))
        return dst

    def drain(self, *_: object) -> None:
        try:
            self.lane.drain()
        finally:
            for t in self.order.drain():
                self._release(t)
            self._collective_operands.clear()

    settle = end_of_backward = drain
    """On the CPU the lane is the only work out of program order: settling, and the end of
    backward's wait for the post-backward stream, are waiting for it."""

    def _no_streams(self, *_: object) -> None:
        """The CPU has no streams: one stream waiting for another, or a tensor's use on one,
        needs nothing (the lane orders the work)."""

    wait_stream = record_stream = _no_streams

    def free_marker(self) -> Waitable:
        return _REACHED

    def all_gather(self, out: torch.Tensor, src: torch.Tensor) -> Pending | None:
        self._log.add("all_gather", Group.SHARD, out.dtype, out.numel())
        group = self._groups.gather_group
        work: Waitable | None
        if group.size() == 1:  # the output is the input: no collective
            if out.data_ptr() != src.data_ptr():
                out.copy_(src)
            return None
        if gather_by_broadcasts(out.nbytes):
            work = broadcast_gather(out, src, group)
        else:
            work = all_gather_flat(out, src, group, async_op=True)
        if work is None:
            return None
        pending = Pending(work, (src, out))
        if gather_waits(out.nbytes):
            pending.wait()
            return None
        return pending


def _copied(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A one-rank reduce-scatter (``ScatterForm.LOCAL``): the input is the result."""
    dst.copy_(src)


def gloo_reduce_scatter(
    dst: torch.Tensor, src: torch.Tensor, group: dist.ProcessGroup, chunks: torch.Tensor | None
) -> Pending:
    """A summing reduce-scatter on gloo, in the form ``fsdp_core.execution.lane.scatter_form``
    chose: with a receive buffer ``chunks`` (the size of ``src``) an all-to-all into it and a
    local sum of the chunks; without, an in-place all-reduce of ``src`` (which the plan frees
    right after) and a copy of this rank's chunk."""
    if chunks is None:
        chunk = src.narrow(0, group.rank() * dst.numel(), dst.numel())
        reduced = dist.all_reduce(src, group=group, async_op=True)

        def land_chunk() -> None:
            dst.copy_(chunk)

        return Pending(reduced, (src, dst), then=land_chunk)
    exchange = dist.all_to_all_single(chunks, src, group=group, async_op=True)

    def land_sum() -> None:
        first, *rest = chunks.view(group.size(), -1)
        if rest:
            torch.add(first, rest[0], out=dst)
            for chunk in rest[1:]:
                dst.add_(chunk)
        else:
            dst.copy_(first)

    return Pending(exchange, (src, chunks, dst), then=land_sum)
