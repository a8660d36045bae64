"""The one interpreter: run a plan's ops, each as one call of the runtime.

``PlanRun`` steps through a plan with one ``match`` over the closed op union and turns every op
into one call: of the ``Runtime`` (``fsdp_shell.runtime.protocol``) for what touches a device or
a process group, of the ``PlanOwner`` (the unit's flat parameter) for what changes the
parameter or its ``.grad``, or of its own buffer table for inputs and frees. Where and when the
work happens is the runtime's business; the interpreter knows no device. A run binds each input
as its ``Input`` op comes and holds a buffer only until the plan frees it.

A buffer is bound to one tensor, except a per-parameter unit's unsharded gradients: one tensor
per parameter (``Grads``), as autograd leaves them. The ops that touch those (the copy-in, casts
and accumulation inside ``no_sync``, records, frees, hand-off) work part by part; the rest take
one tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol, assert_never

import torch

from fsdp_core import (
    Accumulate,
    AllReduce,
    AllReduceHookCall,
    Buffer,
    Cast,
    CommHookCall,
    CopyIn,
    Divide,
    EndOfBackwardWait,
    Free,
    FreeUnshardedParam,
    GradViews,
    HandOff,
    Input,
    InputRole,
    Offload,
    Op,
    Pad,
    Plan,
    RecordStream,
    ReduceScatter,
    ShardView,
    WaitStream,
)
from fsdp_shell.runtime.protocol import Runtime
from fsdp_shell.units.grads import Grads
from fsdp_shell.units.per_param import copy_in_grads

__all__ = ["CommHookFn", "PlanOwner", "PlanRun"]

CommHookFn = Callable[[torch.Tensor, torch.Tensor | None], None]
"""A bound comm hook: ``hook(grad, output)`` (``output`` None for in-place reduction)."""

_HOST = torch.device("cpu")


class PlanOwner(Protocol):
    """What the interpreter calls back into: the flat parameter's handle."""

    def free_unsharded(self) -> None:
        """Reshard: free the unsharded parameters (the flat one, or a per-parameter unit's)."""

    def expose_views(self, grad: Grads, views: tuple[ShardView, ...]) -> None:
        """Point the original parameters' ``.grad`` at ``views`` of ``grad``."""

    def take_carried(self, role: InputRole) -> Grads:
        """The carried gradient under ``role``, given up to the run (no longer held by the owner)."""

    def hand_off(self, plan: Plan, grad: Grads) -> None:
        """Take the gradient ``plan`` hands off."""

    def host_grad_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The host buffer an offload copies into (kept across backwards)."""


class PlanRun:
    """One execution of one plan for one unit.

    ``run_hook_ops`` runs the ops of the post-backward hook, ``run_callback_ops`` those deferred
    to the end-of-backward callback. The run binds its inputs as its ``Input`` ops come (it keeps
    no reference to them before or after) and holds a buffer only until the plan's ``Free``; the
    runtime holds a collective's operands until it has completed.
    """

    def __init__(
        self,
        plan: Plan,
        runtime: Runtime,
        owner: PlanOwner,
        grad: Grads,
        comm_hook: CommHookFn | None = None,
        all_reduce_hook: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.plan = plan
        self._runtime = runtime
        self._owner = owner
        self._grad: Grads | None = grad
        self._comm_hook = comm_hook
        self._all_reduce_hook = all_reduce_hook
        self._buffers: dict[str, tuple[torch.Tensor, ...]] = {}
        """Each live buffer's tensors: one, or a per-parameter unit's gradients (``_multi``)."""
        self._multi: set[str] = set()
        """The buffers bound to a per-parameter unit's gradients, one tensor per parameter."""
        self._index = 0
        self.done = False
        """Whether every op has run (the gradient is handed off)."""

    @property
    def owner(self) -> PlanOwner:
        """Whose gradient the plan processes."""
        return self._owner

    @property
    def live(self) -> tuple[str, ...]:
        """The buffers the run holds now; none once a sound plan has run (it frees or hands off
        each)."""
        return tuple(self._buffers)

    def run_hook_ops(self) -> None:
        """Run the ops that belong in the post-backward hook (``Runtime.begin_plan`` first)."""
        self._runtime.begin_plan()
        for op in self.plan.hook_ops:
            self._step(op)

    def run_callback_ops(self) -> None:
        """Run the ops deferred to the end of backward."""
        for op in self.plan.callback_ops:
            self._step(op)
        self.done = True

    def _parts(self, b: Buffer) -> tuple[torch.Tensor, ...]:
        try:
            return self._buffers[b.name]
        except KeyError:
            raise RuntimeError(f"plan buffer {b.name} is not live") from None

    def _tensor(self, b: Buffer) -> torch.Tensor:
        found = self._parts(b)
        if b.name in self._multi:
            raise TypeError(f"plan buffer {b.name}: expected one tensor, got a per-parameter unit's gradients")
        return found[0]

    def _step(self, op: Op) -> None:
        rt = self._runtime
        index = self._index
        self._index += 1
        match op:
            case Input():
                if op.role is not InputRole.GRAD:
                    if self.done:
                        raise RuntimeError(f"the plan run has finished; no carried {op.role.value} gradient to take")
                    value = self._owner.take_carried(op.role)
                elif self._grad is None:
                    raise RuntimeError("the plan takes the new gradient twice")
                else:
                    value, self._grad = self._grad, None
                if isinstance(value, tuple):
                    self._multi.add(op.buffer.name)
                self._buffers[op.buffer.name] = value if isinstance(value, tuple) else (value,)
            case WaitStream():
                rt.wait_stream(op.stream, op.waits_for)
            case EndOfBackwardWait():
                rt.end_of_backward(op.stream, op.waits_for)
            case RecordStream():
                for t in self._parts(op.buffer):
                    rt.record_stream(t, op.stream)
            case Free():
                # the runtime takes the memory back, unless the same tensor lives on under another
                # buffer's name (on the CPU an offload's host buffer is the device buffer itself)
                gone = self._buffers.pop(op.buffer.name, ())
                self._multi.discard(op.buffer.name)
                kept = [t for other in self._buffers.values() for t in other]
                for t in gone:
                    if not any(other is t for other in kept):
                        rt.free(t)
            case FreeUnshardedParam():
                self._owner.free_unsharded()
            case Cast():
                self._cast(op)
            case Pad():
                src = self._tensor(op.src)
                dst = rt.empty(op.dst.numel, op.dst.dtype, src.device, op.stream)
                self._buffers[op.dst.name] = (dst,)

                def pad() -> None:
                    dst[: src.numel()].copy_(src)
                    dst[src.numel() :].zero_()

                rt.compute(op.stream, pad, (src, dst))
            case CopyIn():
                grads = self._parts(op.src)
                dst = rt.empty(op.dst.numel, op.dst.dtype, grads[0].device, op.stream)
                self._buffers[op.dst.name] = (dst,)
                rt.compute(op.stream, partial(copy_in_grads, op.layout, grads, dst), (*grads, dst))
            case Divide():
                t, factor = self._tensor(op.buffer), op.factor
                rt.compute(op.stream, partial(t.div_, factor), (t,))
            case ReduceScatter():
                src = self._tensor(op.src)
                dst = rt.empty(op.dst.numel, op.dst.dtype, src.device, op.stream)
                self._buffers[op.dst.name] = (dst,)
                rt.reduce_scatter(op.stream, op.group, dst, src, op.reduce_op, src_dies=index in self.plan.src_dies)
            case AllReduce():
                rt.all_reduce(op.stream, op.group, self._tensor(op.buffer), op.reduce_op)
            case CommHookCall():
                self._hook_call(op)
            case AllReduceHookCall():
                hook = self._all_reduce_hook
                if hook is None:
                    raise RuntimeError("the plan calls the unit's all-reduce hook but none is registered")
                t = self._tensor(op.buffer)
                rt.user_hook(op.stream, partial(hook, t), (t,))
            case Accumulate():
                dsts, srcs = self._parts(op.dst), self._parts(op.src)
                rt.compute(op.stream, partial(torch._foreach_add_, list(dsts), list(srcs)), (*dsts, *srcs))
            case Offload():
                self._offload(op)
            case GradViews():
                # the owner gets the tensor, or a per-parameter unit's gradients
                uses = self._parts(op.buffer)
                shown = uses if op.buffer.name in self._multi else uses[0]
                rt.on_host(partial(self._owner.expose_views, shown, op.views), uses)
            case HandOff():
                uses = self._parts(op.buffer)
                grad = uses if op.buffer.name in self._multi else uses[0]
                del self._buffers[op.buffer.name]
                self._multi.discard(op.buffer.name)
                rt.on_host(partial(self._owner.hand_off, self.plan, grad), uses)
            case _:
                assert_never(op)

    def _cast(self, op: Cast) -> None:
        """``dst = src.to(dst.dtype)``, part by part: each new part in its source's shape."""
        srcs, rt = self._parts(op.src), self._runtime
        dsts = tuple(rt.empty(t.numel(), op.dst.dtype, t.device, op.stream).view(t.shape) for t in srcs)
        self._buffers[op.dst.name] = dsts
        if op.src.name in self._multi:
            self._multi.add(op.dst.name)
        rt.compute(op.stream, partial(torch._foreach_copy_, list(dsts), list(srcs)), (*srcs, *dsts))

    def _hook_call(self, op: CommHookCall) -> None:
        hook = self._comm_hook
        if hook is None:
            raise RuntimeError(f"the plan calls the {op.hook.value} comm hook but none is registered")
        src = self._tensor(op.src)
        in_place = op.src == op.dst
        if in_place:
            out = src
        else:
            out = self._runtime.empty(op.dst.numel, op.dst.dtype, src.device, op.stream)
            self._buffers[op.dst.name] = (out,)

        def call() -> None:
            hook(src, None if in_place else out)

        self._runtime.comm_hook(op.stream, op.group, call, src, out, op.wire_dtype)

    def _offload(self, op: Offload) -> None:
        src = self._tensor(op.src)
        if op.accumulate:
            host = self._tensor(op.dst)
            self._runtime.compute(op.stream, lambda: host.add_(src.to(_HOST)), (src, host))
            return
        numel, dtype = op.dst.numel, op.dst.dtype
        self._buffers[op.dst.name] = (
            self._runtime.to_host(op.stream, src, lambda: self._owner.host_grad_buffer(numel, dtype)),
        )
