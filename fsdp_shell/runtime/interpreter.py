"""The one interpreter: run a plan's ops on real process groups, streams and tensors.

``PlanRun`` steps through a plan with one ``match`` over the closed op union. Where and when an
op's work happens is the ``Runtime``'s business (``fsdp_shell.runtime.cpu``): on CUDA every op is
enqueued on its plan stream; on CPU an op runs in the hook when its operands are ready and on
the lane when it waits for a collective. A run binds each input as its ``Input`` op comes and
holds a buffer only until the plan frees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _make_nccl_premul_sum
from typing_extensions import assert_never

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
from fsdp_core.plan.request import buffers_of
from fsdp_shell.runtime.log import CollectiveLog
from fsdp_shell.runtime.collectives import gloo_reduce_scatter, reduce_scatter_flat
from fsdp_shell.runtime.cpu import Runtime, Waiter

__all__ = ["CarriedInputs", "CommHookFn", "ExecContext", "PlanOwner", "PlanRun", "to_reduce_op"]


CommHookFn = Callable[[torch.Tensor, torch.Tensor | None], None]
"""A bound comm hook: ``hook(grad, output)`` (``output`` None for in-place reduction)."""


@dataclass
class ExecContext:
    """What one rank needs to run plans: its groups, its runtime, and a log of collectives."""

    groups: Mapping[Group, dist.ProcessGroup]
    runtime: Runtime
    log: CollectiveLog
    host_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    gloo_reduce_scatter: bool = False
    """Gloo: summing reduce-scatters by ``collectives.gloo_reduce_scatter``, not torch's emulation."""


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
        if self.ctx.runtime.compute(op.stream, self._touches_pending(op), work):
            self._mark_pending(op)

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
                return gloo_reduce_scatter(dst, src, group, may_overwrite_src=src_dies)
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
