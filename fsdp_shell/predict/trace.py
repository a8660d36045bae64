"""Autograd's side of a training step, recorded with no memory behind it: ``record_trace``.

The model runs one forward and backward under ``FakeTensorMode`` as FSDP would run it: every
unit's parameters are views of one flat parameter in the compute dtype (``split_views``, as
``FlatParamHandle.use_unsharded_views`` makes them), inputs are cast as FSDP1 casts them
(``cast_inputs``), each unit's outputs carry a pre-backward hook and each flat parameter a
post-accumulate-grad hook that takes its gradient, as the shell's hooks do. ``LiveBytes`` on the
fake tensors' ``meta`` storages counts every tensor the model's ops hold, the flat parameters
and the buffers left out (FSDP's side, ``fsdp_core.memory.model_memory``, counts those), and
torch's ``FlopCounterMode`` the work of its ops: the bytes at each hook and step boundary, the
highest between them and the FLOPs until the next are the ``ActivationTrace``. The model is
left as it was.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from fsdp_core import Event, FlatParamLayout, HookEvent, MixedPrecision, PlanRequest
from fsdp_core.memory.activation_trace import ActivationTrace, Mark, TracePoint
from fsdp_shell.fsdp2.units import cast_floats
from fsdp_shell.memory import LiveBytes
from fsdp_shell.memory.live import Window
from fsdp_shell.units.flat_param import OrigParam, split_views
from fsdp_shell.units.forward_io import cast_inputs, tensors_in

__all__ = ["PerParamTraceUnit", "StepFn", "TraceUnit", "record_trace", "record_trace_per_param", "time_trace"]

StepFn = Callable[[nn.Module], torch.Tensor]
"""One forward of a training step: makes its inputs, runs the model, returns the loss."""


@dataclass(frozen=True, slots=True, eq=False)
class TraceUnit:
    """One unit as the trace runs it: its module, the parameters it flattens (none: the unit
    owns no parameter) and its plan request."""

    module: nn.Module
    params: list[OrigParam]
    request: PlanRequest | None
    trainable: bool = True


class _Points:
    """What happens at each point of a step (``point``, by the recorders below); a tree's
    per-backward state as the shell keeps it."""

    def __init__(self) -> None:
        self.backward_started = False
        self.unsharded_for_backward: set[int] = set()

    def point(
        self, at: HookEvent | Mark, taken: Sequence[torch.Tensor] = (), arrived: Sequence[torch.Tensor] = ()
    ) -> None:
        """``at`` happens now; ``taken``: the gradients a post-backward hook takes, freed here;
        ``arrived``: tensors made outside the step that autograd holds from here on (gradients
        kept from ``no_sync`` put back into ``.grad``), counted from here."""
        raise NotImplementedError

    def pre_backward(self, index: int, has_params: bool, grad: torch.Tensor) -> torch.Tensor:
        """A hook on a unit's outputs (``fsdp_shell.hooks.pre_backward``)."""
        if not self.backward_started:
            self.backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        if has_params and index not in self.unsharded_for_backward:
            self.unsharded_for_backward.add(index)
            self.unit_pre_backward(index)
        return grad

    def unit_pre_backward(self, index: int) -> None:
        """Unit ``index``'s pre-backward hook, once per backward."""
        self.point(HookEvent(Event.PRE_BACKWARD, index))

    def end_backward(self) -> None:
        """The end-of-backward callback."""
        self.point(HookEvent(Event.END_BACKWARD, -1))
        self.backward_started = False
        self.unsharded_for_backward.clear()


class _Clock(_Points):
    """The wall-clock time of each point of real steps: from it to the next, in seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[HookEvent | Mark] = []
        self.times: list[float] = []

    def point(
        self, at: HookEvent | Mark, taken: Sequence[torch.Tensor] = (), arrived: Sequence[torch.Tensor] = ()
    ) -> None:
        for t in taken:
            t.untyped_storage().resize_(0)
        self.at.append(at)
        self.times.append(time.perf_counter())


class _Recorder(_Points):
    """The bytes and FLOPs of each point of a fake step."""

    def __init__(self, live: LiveBytes, flops: FlopCounterMode) -> None:
        super().__init__()
        self.live = live
        self.flop_counter = flops
        self.counted = 0
        self.points: list[tuple[HookEvent | Mark, int, int]] = []
        self.peaks: list[int] = []
        self.flops: list[int] = []
        self.window: Window | None = None

    def point(
        self, at: HookEvent | Mark, taken: Sequence[torch.Tensor] = (), arrived: Sequence[torch.Tensor] = ()
    ) -> None:
        if self.window is not None:
            self.live.close_window(self.window)
            self.peaks.append(self.window.peak)
            self.flops.append(self._flops_since())
        self.live.track(arrived)
        before = self.live.current
        for t in taken:
            t.untyped_storage().resize_(0)
        nbytes = before - self.live.current
        self.points.append((at, self.live.current + nbytes, nbytes))
        self.window = self.live.open_window()

    def _flops_since(self) -> int:
        total: int = self.flop_counter.get_total_flops()
        done, self.counted = total - self.counted, total
        return done

    def trace(self) -> ActivationTrace:
        assert self.window is not None
        self.live.close_window(self.window)
        self.peaks.append(self.window.peak)
        self.flops.append(self._flops_since())
        return ActivationTrace(
            points=tuple(
                TracePoint(at=at, live=live, peak=peak, taken=taken, flops=flops)
                for (at, live, taken), peak, flops in zip(self.points, self.peaks, self.flops, strict=True)
            )
        )


def record_trace(
    module: nn.Module,
    units: Sequence[TraceUnit],
    step: StepFn,
    *,
    mixed_precision: MixedPrecision,
    block: int = 1,
) -> ActivationTrace:
    """Autograd's bytes through one forward (``step``) and backward of ``module`` (module
    docstring); ``units`` by unit index, the root (``module`` itself) last; ``block``: each
    storage counted as ``LiveBytes`` counts it."""
    _check_root(module, units)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as undo:
        undo.enter_context(_cpu_buffers(module, fake, mixed_precision.buffer_dtype))
        flats = undo.enter_context(_flat_params(units, fake))
        with (
            fake,
            FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION) as flops,
            LiveBytes("meta", block=block) as live,  # above the counter, which decomposes ops it has no count for
        ):
            live.ignore([*flats.values(), *module.buffers()])
            rec = _Recorder(live, flops)
            _hook_all(units, flats, rec, mixed_precision, undo)
            _run_step(module, step, rec)
            return rec.trace()


def time_trace(
    module: nn.Module,
    units: Sequence[TraceUnit],
    step: StepFn,
    *,
    mixed_precision: MixedPrecision,
    repeats: int = 5,
    warmup: int = 2,
) -> tuple[float, ...]:
    """The same step run for real on the CPU, as ``record_trace`` runs it under the fake mode
    (real flat parameters of small random values, zero buffers; the model is left as it was):
    the median over ``repeats`` runs, after ``warmup`` more, of the seconds from each point to
    the next, in ``record_trace``'s points' order (``ActivationTrace.unit_values`` gives each
    unit's forward and backward). What the model's own ops take, without FSDP's collectives or
    hooks."""
    _check_root(module, units)
    real: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    with contextlib.ExitStack() as undo:
        undo.enter_context(_cpu_buffers(module, real, mixed_precision.buffer_dtype))
        flats = undo.enter_context(_flat_params(units, real))
        clock = _Clock()
        _hook_all(units, flats, clock, mixed_precision, undo)
        runs: list[list[float]] = []
        at: list[HookEvent | Mark] = []
        for run in range(warmup + repeats):
            clock.at, clock.times = [], []
            _run_step(module, step, clock)
            if run >= warmup:
                runs.append([b - a for a, b in itertools.pairwise(clock.times)] + [0.0])
                at = clock.at
        if any(len(r) != len(at) for r in runs):
            raise RuntimeError("the step's hooks fired differently from run to run")
        return tuple(statistics.median(column) for column in zip(*runs))


def _check_root(module: nn.Module, units: Sequence[TraceUnit]) -> None:
    if units[len(units) - 1].module is not module:
        raise ValueError("units: the last unit must be the root module")


def _hook_all(
    units: Sequence[TraceUnit],
    flats: dict[int, nn.Parameter],
    points: _Points,
    mixed_precision: MixedPrecision,
    undo: contextlib.ExitStack,
) -> None:
    root = len(units) - 1
    for index, unit in enumerate(units):
        undo.enter_context(_hooked(unit, index, index == root, flats.get(index), points, mixed_precision))


def _run_step(module: nn.Module, step: StepFn, points: _Points) -> None:
    """One forward and backward, marking the step's boundaries."""
    points.point(Mark.FORWARD_START)
    loss = step(module)
    points.point(Mark.BACKWARD_START)
    torch.autograd.backward(loss)
    points.point(Mark.BACKWARD_END)
    del loss
    points.point(Mark.STEP_END)


def _cpu_attention_flops(query: torch.Size, key: torch.Size, value: torch.Size, *args: object, **kwargs: object) -> int:
    flops: int = sdpa_flop_count(query, key, value)  # type: ignore[no-untyped-call]  # unannotated in torch
    return flops


def _cpu_attention_backward_flops(
    grad_out: torch.Size, query: torch.Size, key: torch.Size, value: torch.Size, *args: object, **kwargs: object
) -> int:
    flops: int = sdpa_backward_flop_count(grad_out, query, key, value)  # type: ignore[no-untyped-call]  # unannotated in torch
    return flops


_CPU_ATTENTION: dict[object, Callable[..., int]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}
"""FLOP counts for the CPU's fused attention, which ``FlopCounterMode`` does not know: those of
the CUDA kernels it stands in for (``sdpa_flop_count``), from the operands' shapes."""


@contextlib.contextmanager
def _cpu_buffers(
    module: nn.Module, making: contextlib.AbstractContextManager[object], dtype: torch.dtype | None
) -> Iterator[None]:
    """Every buffer a tensor on the CPU made under ``making`` (a fake mode, or nothing) for the
    block, floating-point ones in ``dtype`` when given (``cast_buffers``); zeros, their values
    are never needed."""
    saved = [(m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None]
    for m, name, b in saved:
        kind = dtype if dtype is not None and torch.is_floating_point(b) else b.dtype
        with making:
            m._buffers[name] = torch.zeros(b.shape, dtype=kind)
    try:
        yield
    finally:
        for m, name, b in saved:
            m._buffers[name] = b


@contextlib.contextmanager
def _flat_params(
    units: Sequence[TraceUnit], making: contextlib.AbstractContextManager[object]
) -> Iterator[dict[int, nn.Parameter]]:
    """Each unit's unsharded flat parameter made under ``making`` (a fake mode, or nothing), in
    the compute dtype, small random values, its parameters taken out of their modules for the
    block."""
    flats: dict[int, nn.Parameter] = {}
    saved: list[tuple[nn.Module, str, nn.Parameter | None]] = []
    for index, unit in enumerate(units):
        if unit.request is None:
            continue
        with making:
            data = torch.randn(unit.request.layout.total_numel, dtype=unit.request.compute_dtype) * 0.02
        flats[index] = nn.Parameter(data, requires_grad=unit.trainable)
        for orig in unit.params:
            for m, attr in orig.slots():
                saved.append((m, attr, m._parameters.pop(attr)))
    try:
        yield flats
    finally:
        for m, attr, param in saved:
            m.__dict__.pop(attr, None)
            m._parameters[attr] = param


@contextlib.contextmanager
def _hooked(
    unit: TraceUnit, index: int, is_root: bool, flat: nn.Parameter | None, rec: _Points, mp: MixedPrecision
) -> Iterator[None]:
    """The shell's hooks on ``unit`` for the block (``fsdp_shell.hooks``), recording instead of
    gathering and reducing."""
    request = unit.request

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if flat is not None or is_root:
            rec.point(HookEvent(Event.PRE_FORWARD, index))
        args, kwargs = cast_inputs(mp, args, kwargs, has_params=flat is not None, is_root=is_root)
        if flat is not None and request is not None:
            if not isinstance(request.layout, FlatParamLayout):
                raise TypeError("the trace runs the FSDP1 API's units; a per-parameter unit has no flat parameter")
            for p, view in zip(unit.params, split_views(flat, request.layout)):
                for m, attr in p.slots():
                    setattr(m, attr, view)
        return args, kwargs

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        if is_root:
            rec.point(HookEvent(Event.END_FORWARD, -1))
        if flat is not None:
            rec.point(HookEvent(Event.POST_FORWARD, index))
        if torch.is_grad_enabled():
            for t in tensors_in(out):
                if t.requires_grad:
                    t.register_hook(functools.partial(rec.pre_backward, index, flat is not None))  # type: ignore[no-untyped-call]  # unannotated in torch
        return out

    def post_backward(param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        rec.point(HookEvent(Event.POST_BACKWARD, index), taken=() if grad is None else (grad,))

    handles = [
        unit.module.register_forward_pre_hook(before, with_kwargs=True),
        unit.module.register_forward_hook(after, with_kwargs=True),
    ]
    if flat is not None and flat.requires_grad:
        handles.append(flat.register_post_accumulate_grad_hook(post_backward))  # type: ignore[no-untyped-call]  # unannotated in torch
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# -- fully_shard's units ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class PerParamTraceUnit:
    """One ``fully_shard`` unit as the trace runs it: its module, and per parameter it manages
    (none: the unit has none) where it is registered, its shape and whether it takes gradients;
    ``compute``: the dtype its unsharded parameters are gathered in; ``restores``: whether its
    gradients kept from a ``no_sync`` backward go back into ``.grad`` at its pre-backward
    (``PlanRequest.restores_pending``)."""

    module: nn.Module
    slots: list[list[tuple[nn.Module, str]]]
    shapes: list[tuple[int, ...]]
    trainable: list[bool]
    compute: torch.dtype
    restores: bool = False


def record_trace_per_param(
    module: nn.Module,
    units: Sequence[PerParamTraceUnit],
    step: StepFn,
    *,
    param_dtype: torch.dtype | None,
    accumulating: bool = False,
    block: int = 1,
) -> ActivationTrace:
    """Autograd's bytes through one forward and backward of ``module`` with ``fully_shard``'s
    hooks (``fsdp_shell.fsdp2.state``), as ``record_trace`` records the FSDP1 API's: each unit's
    unsharded parameters are ``nn.Parameter``s of their own in the compute dtype, registered in
    their modules; every unit casts its floating-point inputs to ``param_dtype`` (when given); a
    unit's post-backward takes its parameters' gradients once all of them have arrived and its
    forward inputs' gradients are computed, and the end of backward takes those of units where
    only some arrived (last unit first, the root last). ``accumulating``: a forward-backward
    after one inside ``no_sync``, where units that restore (``PerParamTraceUnit.restores``) find
    their kept gradients in ``.grad`` from their pre-backward hook on. Buffers stay as they are
    (``fully_shard`` casts none). ``units`` by unit index, the root last."""
    if units[len(units) - 1].module is not module:
        raise ValueError("units: the last unit must be the root module")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as undo:
        undo.enter_context(_cpu_buffers(module, fake, None))
        params = undo.enter_context(_unsharded_params(units, fake))
        kept: dict[int, list[torch.Tensor]] = {}
        if accumulating:
            with fake:
                for index, unit in enumerate(units):
                    if unit.restores:
                        kept[index] = [torch.zeros(p.shape, dtype=p.dtype) for p in params[index] if p.requires_grad]
        with (
            fake,
            FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION) as flops,
            LiveBytes("meta", block=block) as live,  # above the counter, which decomposes ops it has no count for
        ):
            live.ignore([*(p for ps in params.values() for p in ps), *module.buffers()])
            rec = _PerParamRecorder(live, flops, params, kept)
            for index, unit in enumerate(units):
                undo.enter_context(_hooked_per_param(unit, index, index == len(units) - 1, rec, param_dtype))
            _run_step(module, step, rec)
            return rec.trace()


class _PerParamRecorder(_Recorder):
    """``_Recorder`` with ``fully_shard``'s post-backward: when every trainable parameter's
    gradient has arrived and no forward input's gradient is still to come
    (``fsdp_shell.fsdp2.state._maybe_reduce``)."""

    def __init__(
        self,
        live: LiveBytes,
        flops: FlopCounterMode,
        params: dict[int, list[nn.Parameter]],
        kept: dict[int, list[torch.Tensor]],
    ) -> None:
        super().__init__(live, flops)
        self.params = params
        self.kept = kept
        self.arrived: dict[int, int] = {}
        self.inputs_pending: dict[int, int] = {}
        self.reduced: set[int] = set()

    def unit_pre_backward(self, index: int) -> None:
        """Kept ``no_sync`` gradients go back into ``.grad`` first (``ParamGroup.restore_pending``)."""
        restored = self.kept.pop(index, [])
        for p, g in zip([p for p in self.params[index] if p.requires_grad], restored):
            p.grad = g
        self.point(HookEvent(Event.PRE_BACKWARD, index), arrived=restored)

    def grad_arrived(self, index: int) -> None:
        self.arrived[index] = self.arrived.get(index, 0) + 1
        self.maybe_reduce(index)

    def input_done(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        self.inputs_pending[index] = self.inputs_pending.get(index, 0) - 1
        self.maybe_reduce(index)
        return grad

    def maybe_reduce(self, index: int) -> None:
        trainable = [p for p in self.params[index] if p.requires_grad]
        if self.arrived.get(index, 0) == len(trainable) and self.inputs_pending.get(index, 0) <= 0:
            self.reduce(index)

    def reduce(self, index: int) -> None:
        if index in self.reduced:
            return
        self.reduced.add(index)
        grads = []
        for p in self.params[index]:
            if p.grad is not None:
                grads.append(p.grad)
                p.grad = None
        self.point(HookEvent(Event.POST_BACKWARD, index), taken=grads)

    def end_backward(self) -> None:
        for index in sorted(self.params, reverse=True):
            if any(p.grad is not None for p in self.params[index]):
                self.reduce(index)
        super().end_backward()
        self.arrived.clear()
        self.inputs_pending.clear()
        self.reduced.clear()


@contextlib.contextmanager
def _unsharded_params(
    units: Sequence[PerParamTraceUnit], making: contextlib.AbstractContextManager[object]
) -> Iterator[dict[int, list[nn.Parameter]]]:
    """Each unit's unsharded parameters made under ``making`` in the compute dtype, small random
    values, registered where the originals are for the block."""
    params: dict[int, list[nn.Parameter]] = {}
    saved: list[tuple[nn.Module, str, nn.Parameter | None]] = []
    for index, unit in enumerate(units):
        if not unit.shapes:
            continue
        made = []
        for slots, shape, trainable in zip(unit.slots, unit.shapes, unit.trainable, strict=True):
            with making:
                p = nn.Parameter(torch.randn(shape, dtype=unit.compute) * 0.02, requires_grad=trainable)
            made.append(p)
            for m, attr in slots:
                saved.append((m, attr, m._parameters[attr]))
                m._parameters[attr] = p
        params[index] = made
    try:
        yield params
    finally:
        for m, attr, param in reversed(saved):
            m._parameters[attr] = param


@contextlib.contextmanager
def _hooked_per_param(
    unit: PerParamTraceUnit, index: int, is_root: bool, rec: _PerParamRecorder, param_dtype: torch.dtype | None
) -> Iterator[None]:
    """``fully_shard``'s hooks on ``unit`` for the block (``fsdp_shell.fsdp2.state``), recording
    instead of gathering and reducing."""
    params = rec.params.get(index, [])

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if params or is_root:
            rec.point(HookEvent(Event.PRE_FORWARD, index))
        args, kwargs = cast_floats(param_dtype, (args, kwargs))
        if params and torch.is_grad_enabled() and any(p.requires_grad for p in params):
            hooked = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
            rec.inputs_pending[index] = rec.inputs_pending.get(index, 0) + len(hooked)
            for t in hooked:
                t.register_hook(functools.partial(rec.input_done, index))  # type: ignore[no-untyped-call]  # unannotated in torch
        return args, kwargs

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        if is_root:
            rec.point(HookEvent(Event.END_FORWARD, -1))
        if params:
            rec.point(HookEvent(Event.POST_FORWARD, index))
            if torch.is_grad_enabled():
                for t in tensors_in(out):
                    if t.requires_grad:
                        t.register_hook(functools.partial(rec.pre_backward, index, True))  # type: ignore[no-untyped-call]  # unannotated in torch
        return out

    handles = [
        unit.module.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
        unit.module.register_forward_hook(after, with_kwargs=True),
    ]
    for p in params:
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda _p: rec.grad_arrived(index)))  # type: ignore[no-untyped-call]  # unannotated in torch
    try:
        yield
    finally:
        for h in handles:
            h.remove()
