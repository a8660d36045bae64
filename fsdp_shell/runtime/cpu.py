"""The CPU runtime: plan ops on the host thread when their operands are ready, on one lane thread
when they must wait for a collective.

There is no device queue on a CPU, so an op runs on the host thread that reaches it, unless it
must wait for an asynchronous collective: then it is deferred to the ``Lane``, one FIFO worker
thread that waits for the collective (``Work.wait()``) and then runs what depends on it, while
the hook returns and autograd goes on.

Every process group has exactly one issuer, so collectives are issued in the same order on
every rank whatever the timing: the host thread inside the hooks for the shard group (and the
all-gathers), the lane for the replicate group. Nothing polls for completion.

Memory is a function of program order, not of timing. Where work runs depends only on what the
host has waited for, never on whether the lane happens to be done already; at each plan's start
the host waits for the lane work of plans more than ``PLANS_IN_FLIGHT`` back, and only then
returns what those freed; a buffer a collective used is freed by shrinking its storage at that
point, since gloo's threads may still hold a reference to it for a moment after ``wait()``
returns (``LiveBytes`` saw one in four all-gather inputs outlive the wait).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from fsdp_core import PLANS_IN_FLIGHT, Group, ReduceKind, ReduceOpSpec, Stream
from fsdp_core.memory import GLOO_ALL_TO_ALL_MAX_BYTES, GLOO_ASYNC_GATHER_MAX_BYTES
from fsdp_shell.runtime.collectives import all_gather_flat, completed, reduce_scatter_flat, release, to_reduce_op
from fsdp_shell.runtime.groups import ProcessGroups
from fsdp_shell.runtime.log import CollectiveLog
from fsdp_shell.runtime.protocol import Pending, Waitable

__all__ = [
    "ALL_TO_ALL_MAX_BYTES",
    "ASYNC_GATHER_MAX_BYTES",
    "CpuRuntime",
    "Lane",
    "gloo_receive_buffer",
    "gloo_reduce_scatter",
]

ASYNC_GATHER_MAX_BYTES = GLOO_ASYNC_GATHER_MAX_BYTES
"""On CPU, all-gathers up to this size stay in flight while the host goes on (prefetch);
larger ones land before ``all_gather`` returns. Gloo gathers through a temporary buffer the
size of the output, and a large one in flight during the next unit's backward raises the peak
above FSDP1's (synchronous on CPU) by that much (``benchmarks/bench_training.py``, "large")."""


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
    """Ops run on the host thread when ready, on the lane when they must wait.

    Work goes to the lane when a tensor it uses was last used by lane work the host has not
    waited for, or when its stream already has such work there (stream order, as on a CUDA
    stream: with ``hybrid_all_reduce="sync"`` the next unit's reduce-scatter waits behind this
    unit's all-reduce on the post-backward stream). A collective goes to the lane only if its
    group is one the lane issues: the replicate group always; the shard group too when the
    all-gathers have a group of their own (``lane_issues_shard``), so the host issues nothing
    else on it. Otherwise the host first waits for the lane to catch up, then issues it itself
    and waits for it: a shard-group reduction still in flight would hold a unit's unsharded
    gradient while the next unit's backward allocates its own, which on a CPU with no device of
    its own buys no speed on gloo and costs that much peak memory over FSDP1
    (``benchmarks/bench_training.py``). Either way each group's collectives are issued one after
    another by one thread at a time, in program order. The replicate all-reduce, the slow
    inter-node one, is issued by the lane and overlaps later backward work, of at most
    ``PLANS_IN_FLIGHT`` units (``begin_plan``).

    What the host "has waited for" is a ticket it moves forward only at ``begin_plan`` and
    ``drain``, never because the lane happens to be done, so where work runs and when memory is
    returned follow from program order alone (module docstring)."""

    def __init__(self, groups: ProcessGroups, log: CollectiveLog, *, lane_issues_shard: bool = False) -> None:
        self.lane = Lane(log)
        self._groups = groups
        self._log = log
        self._gloo = groups.backend == "gloo"
        self.lane_issues_shard = lane_issues_shard
        self._lane_issues = frozenset({Group.REPLICATE, Group.SHARD} if lane_issues_shard else {Group.REPLICATE})
        self._tail: dict[Stream | Group, int] = {}
        """The ticket of the last lane work of each stream and group."""
        self._last_use: dict[int, int] = {}
        """By ``id`` of a tensor: the ticket of the last lane work that used it. A tensor cannot
        be freed (and its ``id`` reused) while that work has not run: the work holds it."""
        self._waited = 0
        """The host has waited for the lane work through this ticket."""
        self._plan_marks: deque[int] = deque(maxlen=PLANS_IN_FLIGHT + 1)
        """The lane's last ticket when each of the latest plans began."""
        self._frees: list[tuple[int, torch.Tensor]] = []
        """Tensors the plans freed while lane work through the ticket may use them."""
        self._collective_operands: set[int] = set()
        """By ``id``: tensors a collective has read or written since the last drain."""
        self.most_plans_in_flight = 0
        """The most plans whose lane work the host had not waited for when a plan began (the
        bound's witness, for tests)."""

    # -- ordering ------------------------------------------------------------------------------

    def _behind(self, keys: tuple[Stream | Group, ...], uses: tuple[torch.Tensor, ...]) -> bool:
        waited = self._waited
        return any(self._tail.get(k, 0) > waited for k in keys) or any(
            self._last_use.get(id(t), 0) > waited for t in uses
        )

    def _defer(
        self, work: Callable[[], object], keys: tuple[Stream | Group, ...], uses: tuple[torch.Tensor, ...]
    ) -> None:
        ticket = self.lane.submit(work)
        for key in keys:
            self._tail[key] = ticket
        for t in uses:
            self._last_use[id(t)] = ticket

    def _collective(
        self, stream: Stream, group: Group, issue: Callable[[], Pending | None], uses: tuple[torch.Tensor, ...]
    ) -> None:
        self._collective_operands.update(id(t) for t in uses)
        keys = (stream, group)
        behind = self._behind(keys, uses)
        if group is Group.REPLICATE or (behind and group in self._lane_issues):
            self._defer(lambda: completed(issue, uses), keys, uses)
            return
        if behind:
            self.drain()
        completed(issue, uses)

    def _wait_through(self, ticket: int) -> None:
        if ticket <= self._waited:
            return
        self.lane.wait_through(ticket)
        self._waited = ticket
        due = [t for k, t in self._frees if k <= ticket]
        self._frees = [(k, t) for k, t in self._frees if k > ticket]
        for t in due:
            self._release(t)

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
        ticket = self._last_use.get(id(tensor), 0)
        if ticket > self._waited:
            self._frees.append((ticket, tensor))
        else:
            self._release(tensor)

    def begin_plan(self) -> None:
        marks = self._plan_marks
        marks.append(self.lane.submitted)
        self.most_plans_in_flight = max(self.most_plans_in_flight, sum(1 for m in list(marks)[1:] if m > self._waited))
        if len(marks) == marks.maxlen:
            self._wait_through(marks[0])

    def compute(self, stream: Stream, work: Callable[[], object], uses: tuple[torch.Tensor, ...]) -> None:
        if self._behind((stream,), uses):
            self._defer(work, (stream,), uses)
        else:
            work()

    def on_host(self, work: Callable[[], None], uses: tuple[torch.Tensor, ...]) -> None:
        if self._behind((), uses):
            self.drain()
        work()

    def reduce_scatter(
        self, stream: Stream, group: Group, dst: torch.Tensor, src: torch.Tensor, op: ReduceOpSpec, *, src_dies: bool
    ) -> None:
        pg = self._groups.of(group)
        if not (self._gloo and op.kind is ReduceKind.SUM):

            def issue() -> Pending | None:
                self._log.add("reduce_scatter", group, src.dtype, src.numel())
                work = reduce_scatter_flat(dst, src, pg, to_reduce_op(op), async_op=True)
                return None if work is None else Pending(work, (src, dst))

            self._collective(stream, group, issue, (src, dst))
            return
        chunks = gloo_receive_buffer(src, may_overwrite_src=src_dies)

        def issue_on_gloo() -> Pending | None:
            self._log.add("reduce_scatter", group, src.dtype, src.numel())
            return gloo_reduce_scatter(dst, src, pg, chunks)

        self._collective(stream, group, issue_on_gloo, (src, dst) if chunks is None else (src, dst, chunks))
        if chunks is not None:
            self.free(chunks)

    def all_reduce(self, stream: Stream, group: Group, tensor: torch.Tensor, op: ReduceOpSpec) -> None:
        pg = self._groups.of(group)

        def issue() -> Pending | None:
            self._log.add("all_reduce", group, tensor.dtype, tensor.numel())
            work = dist.all_reduce(tensor, op=to_reduce_op(op), group=pg, async_op=True)
            return None if work is None else Pending(work, (tensor,))

        self._collective(stream, group, issue, (tensor,))

    def comm_hook(
        self,
        stream: Stream,
        group: Group,
        call: Callable[[], None],
        src: torch.Tensor,
        out: torch.Tensor,
        wire_dtype: torch.dtype,
    ) -> None:
        def issue() -> None:
            self._log.add("comm_hook", group, wire_dtype, src.numel())
            call()

        self._collective(stream, group, issue, (src, out))

    def to_host(self, stream: Stream, src: torch.Tensor, buffer: Callable[[], torch.Tensor]) -> torch.Tensor:
        if src.device.type == "cpu":
            return src
        dst = buffer()
        self.compute(stream, lambda: dst.copy_(src), (src, dst))
        return dst

    def wait_stream(self, stream: Stream, waits_for: Stream) -> None:
        return None

    def end_of_backward(self, stream: Stream, waits_for: Stream) -> None:
        self.drain()

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        return None

    def drain(self) -> None:
        self._tail.clear()
        self._last_use.clear()
        self._plan_marks.clear()
        try:
            self.lane.drain()
        finally:
            self._waited = self.lane.submitted
            frees, self._frees = self._frees, []
            for _, t in frees:
                self._release(t)
            self._collective_operands.clear()

    def settle(self) -> None:
        self.drain()

    def free_marker(self) -> Waitable:
        return _REACHED

    def all_gather(self, out: torch.Tensor, src: torch.Tensor) -> Pending | None:
        self._log.add("all_gather", Group.SHARD, out.dtype, out.numel())
        work = all_gather_flat(out, src, self._groups.gather_group, async_op=True)
        if work is None:
            return None
        pending = Pending(work, (src, out))
        if out.nbytes > ASYNC_GATHER_MAX_BYTES:
            pending.wait()
            return None
        return pending


ALL_TO_ALL_MAX_BYTES = GLOO_ALL_TO_ALL_MAX_BYTES
"""Gloo reduce-scatters of inputs up to this size go by all-to-all (fast, one more buffer; the
memory prediction, ``fsdp_core.memory``, prices it from the same constant)."""


def gloo_receive_buffer(src: torch.Tensor, *, may_overwrite_src: bool) -> torch.Tensor | None:
    """The receive buffer ``gloo_reduce_scatter`` needs for ``src`` (None: it needs none),
    allocated by the caller, on the host thread, so that memory follows program order."""
    if may_overwrite_src and src.numel() * src.element_size() > ALL_TO_ALL_MAX_BYTES:
        return None
    return torch.empty_like(src)


def gloo_reduce_scatter(
    dst: torch.Tensor, src: torch.Tensor, group: dist.ProcessGroup, chunks: torch.Tensor | None
) -> Pending:
    """A summing reduce-scatter on gloo, which has none of its own (torch emulates it with an
    all-reduce of a copy of ``src``: twice the bytes of a reduce-scatter, one more buffer).

    With a receive buffer ``chunks`` (``gloo_receive_buffer``: up to ``ALL_TO_ALL_MAX_BYTES``,
    or when ``src`` must survive): an all-to-all (every rank sends each other rank its chunk,
    the bytes of a ring reduce-scatter) into it and a local sum of the chunks, 4-8x faster than
    torch's emulation on loopback (``benchmarks/bench_collectives.py``). Without: an in-place
    all-reduce of ``src``, which the plan frees right after, and a copy of this rank's chunk,
    which needs no buffer beyond ``src`` and ``dst``, as the unsharded gradient dominates
    memory there."""
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
