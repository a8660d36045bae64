"""The one interpreter: run a plan's ops on real process groups, streams and tensors.

``execute`` is one loop over ops with a ``match`` on the closed op union. All mutable run state
lives in an ``ExecContext``. Streams are ``StreamRuntime`` objects:

- on CUDA, a real ``torch.cuda.Stream``; ops are launched in its context, waits are
  ``wait_stream``, ``record_stream`` tells the caching allocator;
- on CPU, an ordered queue. A collective is issued with ``async_op=True``; ops enqueued on
  its stream after it wait in the queue until it completes, while the hook returns and other
  streams (and autograd) go on. A ``WaitStream`` drains the stream it waits for. So the
  hybrid all-reduce really overlaps the next unit's backward and reduce-scatter on CPU too.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

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
    Destination,
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

__all__ = ["CommHookFn", "ExecContext", "PlanOwner", "PlanRun", "StreamRuntime", "to_reduce_op"]

CommHookFn = Callable[[torch.Tensor, torch.Tensor | None], None]
"""A bound comm hook: ``hook(grad, output)`` (``output`` None for in-place reduction)."""


class PlanOwner(Protocol):
    """What the interpreter calls back into: the flat parameter's handle."""

    def free_unsharded(self) -> None:
        """Reshard: free the unsharded flat parameter."""

    def set_grad_views(self, grad: torch.Tensor, views: tuple[ShardView, ...]) -> None:
        """Point the original parameters' ``.grad`` at ``views`` of ``grad``."""

    def receive(self, grad: torch.Tensor, destination: Destination) -> None:
        """Take the gradient the plan hands off."""


class StreamRuntime:
    """One plan stream on one rank: a CUDA stream, or an ordered CPU queue of pending ops."""

    def __init__(self, cuda_stream: torch.cuda.Stream | None = None) -> None:
        self.cuda_stream = cuda_stream
        self._queue: deque[Callable[[], object]] = deque()
        self._work: list[tuple[dist.Work, tuple[torch.Tensor, ...]]] = []

    def allocating(self) -> contextlib.AbstractContextManager[object]:
        """Allocate device memory under this stream, so the caching allocator attributes the
        block to it, as the plan's ``Free(buffer, stream)`` assumes."""
        if self.cuda_stream is not None:
            return torch.cuda.stream(self.cuda_stream)
        return contextlib.nullcontext()

    @property
    def idle(self) -> bool:
        """No queued ops and no collective in flight (always true on CUDA)."""
        return not self._queue and not self._work

    def submit(self, thunk: Callable[[], object]) -> None:
        """Run ``thunk`` in stream order: now if the stream is idle, else after what is ahead."""
        if self.cuda_stream is not None:
            with torch.cuda.stream(self.cuda_stream):
                thunk()
            return
        self.progress()
        if self.idle:
            thunk()
        else:
            self._queue.append(thunk)

    def track(self, work: dist.Work | None, tensors: tuple[torch.Tensor, ...]) -> None:
        """Hold ``work`` (and the tensors it reads and writes, alive) until it completes. On
        CUDA the stream itself waits for the collective, without blocking the CPU."""
        if work is None:
            return
        if self.cuda_stream is not None:
            work.wait()
            return
        self._work.append((work, tensors))

    def progress(self) -> None:
        """Run queued ops whose predecessors have completed, without blocking."""
        while True:
            pending = []
            for w, t in self._work:
                if w.is_completed():
                    w.wait()
                else:
                    pending.append((w, t))
            self._work = pending
            if self._work or not self._queue:
                return
            self._queue.popleft()()

    def drain(self) -> None:
        """Block until every op submitted to this stream has run and completed."""
        while True:
            for w, _ in self._work:
                w.wait()
            self._work = []
            if not self._queue:
                return
            self._queue.popleft()()


@dataclass
class ExecContext:
    """What one rank needs to run plans: its groups and streams, and a log of collectives."""

    groups: Mapping[Group, dist.ProcessGroup]
    streams: Mapping[Stream, StreamRuntime]
    host_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    collectives: list[tuple[str, Group, torch.dtype, int]] = field(default_factory=list)
    """Every collective issued, as (op, group, dtype, numel): for tests and communication counts."""
    overlapped_hooks: int = 0
    """Post-backward hooks entered while an earlier plan's work was still queued or in flight on
    a side stream (CPU): how often communication overlapped later backward work."""


@dataclass
class PlanRun:
    """One execution of one plan: its owner, its inputs and its live buffers.

    ``hook_phase`` runs the ops of the post-backward hook; ``callback_phase`` the ops deferred
    to the end-of-backward callback.
    """

    plan: Plan
    ctx: ExecContext
    owner: PlanOwner
    inputs: Mapping[InputRole, torch.Tensor]
    comm_hook: CommHookFn | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def tensor(self, b: Buffer) -> torch.Tensor:
        try:
            return self.buffers[b.name]
        except KeyError:
            raise RuntimeError(f"plan buffer {b.name} is not live") from None

    def hook_phase(self) -> None:
        """Run the ops that belong in the post-backward hook."""
        for runtime in self.ctx.streams.values():
            runtime.progress()
        if any(not self.ctx.streams[s].idle for s in (Stream.POST_BACKWARD, Stream.ALL_REDUCE)):
            self.ctx.overlapped_hooks += 1
        for op in self.plan.hook_ops:
            _step(op, self)

    def callback_phase(self) -> None:
        """Run the ops deferred to the end of backward."""
        for op in self.plan.callback_ops:
            _step(op, self)


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


def _step(op: Op, run: PlanRun) -> None:
    ctx = run.ctx
    stream = ctx.streams[op.stream]
    match op:
        case Input():
            run.buffers[op.buffer.name] = run.inputs[op.role]
        case WaitStream() | EndOfBackwardWait():
            other = ctx.streams[op.waits_for]
            if stream.cuda_stream is not None and other.cuda_stream is not None:
                stream.cuda_stream.wait_stream(other.cuda_stream)
            else:
                stream.submit(other.drain)
                if isinstance(op, EndOfBackwardWait):
                    stream.drain()
        case RecordStream():
            if stream.cuda_stream is not None:
                t = run.tensor(op.buffer)
                if t.is_cuda:
                    t.record_stream(stream.cuda_stream)
        case Free():
            run.buffers.pop(op.buffer.name, None)
        case FreeUnshardedParam():
            stream.submit(run.owner.free_unsharded)
        case Cast():
            src = run.tensor(op.src)
            with stream.allocating():
                dst = torch.empty(op.dst.numel, dtype=op.dst.dtype, device=src.device)
            run.buffers[op.dst.name] = dst
            stream.submit(lambda: dst.copy_(src))
        case Pad():
            src = run.tensor(op.src)
            with stream.allocating():
                dst = torch.empty(op.dst.numel, dtype=op.dst.dtype, device=src.device)
            run.buffers[op.dst.name] = dst

            def pad() -> None:
                dst[: src.numel()].copy_(src)
                dst[src.numel() :].zero_()

            stream.submit(pad)
        case Divide():
            t = run.tensor(op.buffer)
            factor = op.factor
            stream.submit(lambda: t.div_(factor))
        case ReduceScatter():
            src = run.tensor(op.src)
            with stream.allocating():
                dst = torch.empty(op.dst.numel, dtype=op.dst.dtype, device=src.device)
            run.buffers[op.dst.name] = dst
            group, reduce_op = ctx.groups[op.group], to_reduce_op(op.reduce_op)
            ctx.collectives.append(("reduce_scatter", op.group, src.dtype, src.numel()))

            def reduce_scatter() -> None:
                work = reduce_scatter_flat(dst, src, group, reduce_op, async_op=True)
                stream.track(work, (src, dst))

            stream.submit(reduce_scatter)
        case AllReduce():
            t = run.tensor(op.buffer)
            group, reduce_op = ctx.groups[op.group], to_reduce_op(op.reduce_op)
            ctx.collectives.append(("all_reduce", op.group, t.dtype, t.numel()))

            def all_reduce() -> None:
                work = dist.all_reduce(t, op=reduce_op, group=group, async_op=True)
                stream.track(work, (t,))

            stream.submit(all_reduce)
        case CommHookCall():
            src = run.tensor(op.src)
            in_place = op.src == op.dst
            with stream.allocating():
                out = src if in_place else torch.empty(op.dst.numel, dtype=op.dst.dtype, device=src.device)
            run.buffers[op.dst.name] = out
            hook = run.comm_hook
            if hook is None:
                raise RuntimeError(f"the plan calls the {op.hook.value} comm hook but none is registered")
            ctx.collectives.append(("comm_hook", op.group, op.wire_dtype, src.numel()))
            stream.submit(lambda: hook(src, None if in_place else out))
        case Accumulate():
            dst_t, src_t = run.tensor(op.dst), run.tensor(op.src)
            stream.submit(lambda: dst_t.add_(src_t))
        case Offload():
            src = run.tensor(op.src)
            if op.accumulate:
                cpu = run.tensor(op.dst)
                stream.submit(lambda: cpu.add_(src.to(ctx.host_device)))
            else:
                cpu = torch.empty(op.dst.numel, dtype=op.dst.dtype, device=ctx.host_device)
                run.buffers[op.dst.name] = cpu
                stream.submit(lambda: cpu.copy_(src))
        case GradViews():
            t = run.tensor(op.buffer)
            views = op.views
            stream.submit(lambda: run.owner.set_grad_views(t, views))
        case HandOff():
            t = run.tensor(op.buffer)
            destination = op.destination
            stream.submit(lambda: run.owner.receive(t, destination))
        case _:
            assert_never(op)
