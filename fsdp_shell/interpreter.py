"""The one interpreter: run a plan's ops on real process groups, streams and tensors.

``PlanRun`` steps through a plan with one ``match`` over the closed op union; where and when an
op's work happens is the runtime's business:

- ``CudaRuntime``: every op is enqueued from the hook on the CUDA stream its plan stream maps
  to; waits are ``wait_stream``, ``record_stream`` tells the caching allocator.
- ``CpuRuntime``: there is no device queue, so an op runs on the host thread that reaches it,
  unless it must wait for an asynchronous collective. A collective is issued with
  ``async_op=True`` and its operands become *pending*; an op touching a pending operand is
  deferred to the *lane*, one FIFO worker thread that waits for the collective
  (``Work.wait()``) and then runs what depends on it, while the hook returns and autograd goes on.

Collectives are issued in the same order on every rank, whatever the timing, because every
process group has exactly one issuer: the shard group's collectives (and the all-gathers) are
issued by the host thread inside the hooks, in program order; the replicate group's all-reduces
by the lane (on CPU), in the order the hooks queued them. Nothing polls for completion: timing
decides when a collective runs, never the order in which collectives are issued.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _make_nccl_premul_sum
from typing_extensions import assert_never

from fsdp_shell.collectives import reduce_scatter_flat

from fsdp_core import (
    Accumulate,
    AllReduce,
    Buffer,
    Cast,
    CommHookCall,
    Divide,
    EndOfBackwardWait,
    Free,
    FreeUnshardedParam,
    GradViews,
    Group,
    HandOff,
    Input,
    InputRole,
    Offload,
    Op,
    Pad,
    Plan,
    RecordStream,
    ReduceKind,
    ReduceOpSpec,
    ReduceScatter,
    ShardView,
    Stream,
    WaitStream,
)
from fsdp_core.plan import buffers_of

__all__ = [
    "CollectiveLog",
    "CollectiveRecord",
    "CommHookFn",
    "CpuRuntime",
    "CudaRuntime",
    "ExecContext",
    "Lane",
    "Phase",
    "PlanOwner",
    "PlanRun",
    "Runtime",
    "to_reduce_op",
]

CommHookFn = Callable[[torch.Tensor, torch.Tensor | None], None]
"""A bound comm hook: ``hook(grad, output)`` (``output`` None for in-place reduction)."""

Waiter = Callable[[], None]
"""Blocks until an issued collective's result is in place (on CUDA: makes the stream wait)."""


class Phase(enum.Enum):
    """Where a collective was issued, for the collective log."""

    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"
    LANE = "lane"
    END_OF_BACKWARD = "end_of_backward"
    OTHER = "other"


class CollectiveRecord(NamedTuple):
    """One collective issued by this rank."""

    op: str
    group: Group
    dtype: torch.dtype
    numel: int
    phase: Phase


class CollectiveLog:
    """Every collective this rank's runtime issued, in issue order per group.

    Records are appended by the host thread and by the lane; within one group there is one
    issuer, so each group's sequence is the order the collectives were issued in."""

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []
        self.phase = Phase.OTHER
        """Where the host thread is now (set by the wrapper's hooks)."""
        self._lane_thread: threading.Thread | None = None

    def add(self, op: str, group: Group, dtype: torch.dtype, numel: int) -> None:
        """Log a collective issued now, by the current thread."""
        on_lane = threading.current_thread() is self._lane_thread
        self.records.append(CollectiveRecord(op, group, dtype, numel, Phase.LANE if on_lane else self.phase))

    def of_group(self, group: Group) -> list[CollectiveRecord]:
        """The records of one group, in the order they were issued."""
        return [r for r in self.records if r.group is group]


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

    defers: bool
    """Whether ops waiting for a collective are deferred (CPU) rather than enqueued (CUDA)."""

    def allocating(self, stream: Stream) -> contextlib.AbstractContextManager[object]:
        """Allocate under ``stream`` (so the caching allocator attributes the block to it)."""

    def compute(self, stream: Stream, deferred: bool, work: Callable[[], object]) -> None:
        """Run element-wise ``work`` in ``stream``'s order; ``deferred``: after pending collectives."""

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
    """Ops run on the host thread when ready, on the lane when they wait for a collective.

    At most ``max_in_flight`` collectives issued by the host thread are outstanding: before
    issuing another, the hook waits for the oldest to land. The default, 0, lands each one
    inside its own hook: a shard-group reduction still in flight holds a unit's unsharded
    gradient while the next unit's backward allocates its own, which on a CPU with no device
    of its own buys no speed on gloo and costs that much peak memory over FSDP1 (measured by
    ``benchmarks/bench_training.py``: +25-35 MiB, +25%, on 8 units of 2048 x 2048 with 1; equal
    with 0). The replicate all-reduce, the slow inter-node one, is issued by the lane and
    overlaps later backward work either way."""

    defers = True
    LANE_GROUPS = frozenset({Group.REPLICATE})
    """Groups whose collectives the lane issues (all of them, always): the replicate
    all-reduce reads a reduce-scatter's result, so only the lane can issue it without blocking."""

    def __init__(self, log: CollectiveLog, max_in_flight: int = 0) -> None:
        self.lane = Lane(log)
        self.max_in_flight = max_in_flight
        self._in_flight: collections.deque[int] = collections.deque()

    def allocating(self, stream: Stream) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def compute(self, stream: Stream, deferred: bool, work: Callable[[], object]) -> None:
        if deferred:
            self.lane.submit(work)
        else:
            work()

    def collective(self, stream: Stream, group: Group, operands_pending: bool,
                   issue: Callable[[], Waiter | None]) -> bool:
        if group in self.LANE_GROUPS:
            self.lane.submit(lambda: _issue_and_wait(issue))
            return True
        if operands_pending:
            self.lane.drain()
        while self._in_flight and len(self._in_flight) >= self.max_in_flight:
            self.lane.wait_for(self._in_flight.popleft())
        waiter = issue()
        if waiter is None:
            return False
        if self.max_in_flight == 0:
            waiter()
            return False
        self._in_flight.append(self.lane.submit(waiter))
        return True

    def wait_stream(self, stream: Stream, waits_for: Stream) -> None:
        return None

    def end_of_backward(self, stream: Stream, waits_for: Stream) -> None:
        self.drain()

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        return None

    def drain(self) -> None:
        self._in_flight.clear()
        self.lane.drain()

    def after_host_copy(self, stream: Stream) -> None:
        return None


def _issue_and_wait(issue: Callable[[], Waiter | None]) -> None:
    waiter = issue()
    if waiter is not None:
        waiter()


class CudaRuntime:
    """Every op enqueued from the hook on its plan stream's CUDA stream."""

    defers = False

    def __init__(self, streams: Mapping[Stream, torch.cuda.Stream]) -> None:
        self.streams = streams
        self._host_copies: list[torch.cuda.Event] = []

    def allocating(self, stream: Stream) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(self.streams[stream])

    def compute(self, stream: Stream, deferred: bool, work: Callable[[], object]) -> None:
        with torch.cuda.stream(self.streams[stream]):
            work()

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


@dataclass
class ExecContext:
    """What one rank needs to run plans: its groups, its runtime, and a log of collectives."""

    groups: Mapping[Group, dist.ProcessGroup]
    runtime: Runtime
    log: CollectiveLog
    host_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    gloo_reduce_scatter: bool = False
    """Gloo: summing reduce-scatters by ``_gloo_reduce_scatter`` instead of torch's emulation."""


class PlanOwner(Protocol):
    """What the interpreter calls back into: the flat parameter's handle."""

    def free_unsharded(self) -> None:
        """Reshard: free the unsharded flat parameter."""

    def set_grad_views(self, grad: torch.Tensor, views: tuple[ShardView, ...]) -> None:
        """Point the original parameters' ``.grad`` at ``views`` of ``grad``."""

    def hand_off(self, plan: Plan, grad: torch.Tensor) -> None:
        """Take the gradient ``plan`` hands off."""

    def host_grad_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The host buffer an offload copies into (pinned and kept, where that matters)."""


class CarriedInputs(Protocol):
    """The carried gradient state a plan binds its non-``GRAD`` inputs from."""

    def take(self, role: InputRole) -> torch.Tensor:
        """The tensor carried under ``role``."""


def to_reduce_op(spec: ReduceOpSpec) -> dist.ReduceOp:
    """The ``torch.distributed`` reduce op for ``spec``."""
    match spec.kind:
        case ReduceKind.SUM:
            return dist.ReduceOp(dist.ReduceOp.SUM)
        case ReduceKind.AVG:
            return dist.ReduceOp(dist.ReduceOp.AVG)
        case ReduceKind.PREMUL_SUM:
            return _make_nccl_premul_sum(spec.premul)
        case _:
            assert_never(spec.kind)


ALL_TO_ALL_MAX_BYTES = 4 << 20
"""Gloo reduce-scatters of inputs up to this size go by all-to-all (fast, one more buffer)."""


def _gloo_reduce_scatter(dst: torch.Tensor, src: torch.Tensor, group: dist.ProcessGroup, *,
                         may_overwrite_src: bool) -> Waiter:
    """A summing reduce-scatter on gloo, which has none of its own (torch emulates it with an
    all-reduce of a copy of ``src``: twice the bytes of a reduce-scatter, one more buffer).

    Up to ``ALL_TO_ALL_MAX_BYTES``, or when ``src`` must survive: an all-to-all (every rank
    sends each other rank its chunk, the bytes of a ring reduce-scatter) into a receive buffer
    and a local sum of the chunks, 4-8x faster than torch's emulation on loopback
    (``benchmarks/bench_collectives.py``). Larger inputs the plan frees right after: an
    in-place all-reduce of ``src`` and a copy of this rank's chunk, which needs no buffer
    beyond ``src`` and ``dst``, as the unsharded gradient dominates memory there."""
    if may_overwrite_src and src.numel() * src.element_size() > ALL_TO_ALL_MAX_BYTES:
        work = dist.all_reduce(src, group=group, async_op=True)
        chunk = src.narrow(0, group.rank() * dst.numel(), dst.numel())

        def land_chunk() -> None:
            work.wait()
            dst.copy_(chunk)

        return land_chunk
    chunks = torch.empty_like(src)
    exchange = dist.all_to_all_single(chunks, src, group=group, async_op=True)

    def land_sum() -> None:
        exchange.wait()
        first, *rest = chunks.view(group.size(), -1)
        if rest:
            torch.add(first, rest[0], out=dst)
            for chunk in rest[1:]:
                dst.add_(chunk)
        else:
            dst.copy_(first)
        assert src.numel()

    return land_sum


def _waiter(work: dist.Work | None, *operands: torch.Tensor) -> Waiter | None:
    """``work.wait``, holding the collective's operands alive until the waiter is dropped."""
    if work is None:
        return None

    def wait() -> None:
        work.wait()
        assert operands

    return wait


class PlanRun:
    """One execution of one plan for one unit.

    ``hook_phase`` runs the ops of the post-backward hook, ``callback_phase`` those deferred to
    the end-of-backward callback. The run binds its inputs as its ``Input`` ops come (it keeps
    no reference to them before or after) and holds a buffer only until the plan's ``Free``;
    a collective's operands are held by its waiter until the collective completes.
    """

    def __init__(self, plan: Plan, ctx: ExecContext, owner: PlanOwner, grad: torch.Tensor,
                 carried: CarriedInputs, comm_hook: CommHookFn | None = None) -> None:
        self.plan = plan
        self.ctx = ctx
        self.owner = owner
        self._grad: torch.Tensor | None = grad
        self._carried = carried
        self._comm_hook = comm_hook
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending: set[str] = set()
        self._index = 0

    @property
    def live_buffers(self) -> tuple[str, ...]:
        """Names of the buffers this run still holds."""
        return tuple(self._buffers)

    def hook_phase(self) -> None:
        """Run the ops that belong in the post-backward hook."""
        for op in self.plan.hook_ops:
            self._step(op)

    def callback_phase(self) -> None:
        """Run the ops deferred to the end of backward."""
        for op in self.plan.callback_ops:
            self._step(op)
        self._carried = _NO_CARRIED

    # -- helpers ---------------------------------------------------------------------------

    def _tensor(self, b: Buffer) -> torch.Tensor:
        try:
            return self._buffers[b.name]
        except KeyError:
            raise RuntimeError(f"plan buffer {b.name} is not live") from None

    def _alloc(self, b: Buffer, stream: Stream, device: torch.device) -> torch.Tensor:
        with self.ctx.runtime.allocating(stream):
            t = torch.empty(b.numel, dtype=b.dtype, device=device)
        self._buffers[b.name] = t
        return t

    def _touches_pending(self, op: Op) -> bool:
        return any(b.name in self._pending for b in buffers_of(op))

    def _mark_pending(self, op: Op) -> None:
        self._pending.update(b.name for b in buffers_of(op))

    def _compute(self, op: Op, work: Callable[[], object]) -> None:
        deferred = self.ctx.runtime.defers and self._touches_pending(op)
        if deferred:
            self._mark_pending(op)
        self.ctx.runtime.compute(op.stream, deferred, work)

    def _collective(self, op: Op, group: Group, issue: Callable[[], Waiter | None]) -> None:
        pending = self.ctx.runtime.collective(op.stream, group, self._touches_pending(op), issue)
        if pending:
            self._mark_pending(op)

    def _on_host_thread(self, op: Op) -> None:
        """Owner callbacks run on the host thread: wait for pending operands first."""
        if self._touches_pending(op):
            self.ctx.runtime.drain()
            self._pending.clear()

    # -- ops -------------------------------------------------------------------------------

    def _step(self, op: Op) -> None:
        ctx = self.ctx
        index = self._index
        self._index += 1
        match op:
            case Input():
                self._bind(op)
            case WaitStream():
                ctx.runtime.wait_stream(op.stream, op.waits_for)
            case EndOfBackwardWait():
                ctx.runtime.end_of_backward(op.stream, op.waits_for)
                self._pending.clear()
            case RecordStream():
                ctx.runtime.record_stream(self._tensor(op.buffer), op.stream)
            case Free():
                self._buffers.pop(op.buffer.name, None)
            case FreeUnshardedParam():
                self.owner.free_unsharded()
            case Cast():
                src = self._tensor(op.src)
                dst = self._alloc(op.dst, op.stream, src.device)
                self._compute(op, lambda: dst.copy_(src))
            case Pad():
                src = self._tensor(op.src)
                dst = self._alloc(op.dst, op.stream, src.device)

                def pad() -> None:
                    dst[: src.numel()].copy_(src)
                    dst[src.numel() :].zero_()

                self._compute(op, pad)
            case Divide():
                t = self._tensor(op.buffer)
                factor = op.factor
                self._compute(op, lambda: t.div_(factor))
            case ReduceScatter():
                self._reduce_scatter(op, index)
            case AllReduce():
                t = self._tensor(op.buffer)
                group, reduce_op, name = ctx.groups[op.group], to_reduce_op(op.reduce_op), op.group

                def all_reduce() -> Waiter | None:
                    ctx.log.add("all_reduce", name, t.dtype, t.numel())
                    return _waiter(dist.all_reduce(t, op=reduce_op, group=group, async_op=True), t)

                self._collective(op, op.group, all_reduce)
            case CommHookCall():
                self._hook_call(op)
            case Accumulate():
                dst_t, src_t = self._tensor(op.dst), self._tensor(op.src)
                self._compute(op, lambda: dst_t.add_(src_t))
            case Offload():
                self._offload(op)
            case GradViews():
                self._on_host_thread(op)
                self.owner.set_grad_views(self._tensor(op.buffer), op.views)
            case HandOff():
                self._on_host_thread(op)
                self.owner.hand_off(self.plan, self._tensor(op.buffer))
                self._buffers.pop(op.buffer.name, None)
            case _:
                assert_never(op)

    def _bind(self, op: Input) -> None:
        if op.role is InputRole.GRAD:
            if self._grad is None:
                raise RuntimeError("the plan takes the new gradient twice")
            self._buffers[op.buffer.name], self._grad = self._grad, None
        else:
            self._buffers[op.buffer.name] = self._carried.take(op.role)

    def _reduce_scatter(self, op: ReduceScatter, index: int) -> None:
        ctx = self.ctx
        src = self._tensor(op.src)
        dst = self._alloc(op.dst, op.stream, src.device)
        group, reduce_op, name = ctx.groups[op.group], to_reduce_op(op.reduce_op), op.group
        gloo = ctx.gloo_reduce_scatter and op.reduce_op.kind is ReduceKind.SUM
        src_dies = gloo and self._src_dies_after(index, op.src)

        def reduce_scatter() -> Waiter | None:
            ctx.log.add("reduce_scatter", name, src.dtype, src.numel())
            if gloo:
                return _gloo_reduce_scatter(dst, src, group, may_overwrite_src=src_dies)
            return _waiter(reduce_scatter_flat(dst, src, group, reduce_op, async_op=True), src, dst)

        self._collective(op, op.group, reduce_scatter)

    def _src_dies_after(self, index: int, src: Buffer) -> bool:
        """Whether no op after ``index`` reads or writes ``src`` before the plan frees it."""
        for op in self.plan.ops[index + 1 :]:
            if isinstance(op, Free) and op.buffer == src:
                return True
            if not isinstance(op, RecordStream) and src in buffers_of(op):
                return False
        return False

    def _hook_call(self, op: CommHookCall) -> None:
        ctx = self.ctx
        src = self._tensor(op.src)
        in_place = op.src == op.dst
        out = src if in_place else self._alloc(op.dst, op.stream, src.device)
        self._buffers[op.dst.name] = out
        hook = self._comm_hook
        if hook is None:
            raise RuntimeError(f"the plan calls the {op.hook.value} comm hook but none is registered")
        name, wire = op.group, op.wire_dtype

        def call() -> None:
            ctx.log.add("comm_hook", name, wire, src.numel())
            hook(src, None if in_place else out)

        self._collective(op, op.group, call)

    def _offload(self, op: Offload) -> None:
        src = self._tensor(op.src)
        host = self.ctx.host_device
        if op.accumulate:
            cpu = self._tensor(op.dst)
            self._compute(op, lambda: cpu.add_(src.to(host)))
            return
        if src.device == host:
            self._buffers[op.dst.name] = src
            if self._touches_pending(op):
                self._mark_pending(op)
            return
        cpu = self.owner.host_grad_buffer(op.dst.numel, op.dst.dtype)
        self._buffers[op.dst.name] = cpu
        runtime, stream = self.ctx.runtime, op.stream

        def copy() -> None:
            cpu.copy_(src, non_blocking=True)
            runtime.after_host_copy(stream)

        self._compute(op, copy)


class _NoCarried:
    def take(self, role: InputRole) -> torch.Tensor:
        raise RuntimeError(f"the plan run has finished; no carried {role.value} gradient to take")


_NO_CARRIED = _NoCarried()
