"""FSDP's hooks on one iteration, as functions of ``(tree, unit)``: the whole runtime state machine.

- ``forward``: a unit's forward. The root's first checks that the ranks agree, drops a backward
  that did not finish and casts floating-point inputs; every unit gathers its parameters (the
  all-gather schedule's actions for ``Event.PRE_FORWARD``), runs its module on views of the
  unsharded flat parameter, reshards as the schedule says and hooks its outputs.
- ``pre_backward`` (a hook on those outputs): the first queues ``end_of_backward`` on the
  autograd engine; each unit gathers its parameters again before its gradient is computed.
- ``post_backward`` (the flat parameter's post-accumulate-grad hook): asks the tree's verifying
  plan cache for the plan of this unit's request and step flags (from the gradient state it
  carries) and runs the plan's hook ops.
- ``end_of_backward``: runs every plan's deferred ops, waits for the side streams (on the CPU:
  the lane), and finishes every unit: original parameters back, what no plan resharded freed,
  ``.grad`` shown where no plan handed one off.

With ``ranks_may_diverge`` every event is first agreed with the other ranks
(``fsdp_shell.safety.sequencer``), and the events another rank runs and this one would skip are
run here too, virtually (``run_virtually``); without, the events are recorded and compared at the
end of backward. FSDP's own collectives of each step turn a backend's timeout into a
``CollectiveTimeoutError`` naming the step and unit.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, assert_never

import torch
import torch.distributed as dist
from torch import nn

from fsdp_core import Event, HookEvent
from fsdp_shell.runtime.collectives import Phase
from fsdp_shell.runtime.interpreter import PlanRun
from fsdp_shell.safety.agreement import RankMismatchError, check_agreement, check_same_events
from fsdp_shell.safety.timeouts import timeout_error
from fsdp_shell.tree import IterationState, Tree
from fsdp_shell.units.forward_io import cast_inputs, tensors_in

__all__ = [
    "abandon_backward",
    "end_of_backward",
    "forward",
    "install",
    "post_backward",
    "pre_backward",
    "run_virtually",
]


def install(tree: Tree) -> None:
    """Hook every trainable unit's flat parameter: ``post_backward`` runs once autograd has
    accumulated its gradient.

    The hook holds the tree weakly. A flat parameter is also held from C++ (as the autograd base
    of its views), where the garbage collector cannot see, so a strong reference from its hook
    back to the tree, which holds the parameter, would be a cycle never collected: a deleted
    model's parameters would stay allocated (as FSDP1's do). Without the tree, no backward of
    its model can run, and the hook has nothing to do."""
    tree_ref = weakref.ref(tree)
    for unit, h in enumerate(tree.handles):
        if h is not None and h.flat_param.requires_grad:
            h.flat_param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]  # unannotated in torch
                functools.partial(post_backward, tree_ref, unit)
            )


# -- forward ------------------------------------------------------------------------------------


def forward(tree: Tree, unit: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``module``'s forward as unit ``unit``: gather, run on the unsharded views, reshard, hook
    the outputs so backward gathers again first. Only the module's own forward is visible to
    ``torch.compile``: FSDP's steps before and after it run eagerly (``torch.compiler.disable``),
    so Dynamo compiles the model between them and never traces a collective or the agreement."""
    grad_on = torch.is_grad_enabled()
    args, kwargs = _before_forward(tree, unit, args, kwargs, grad_on)
    try:
        out = module(*args, **kwargs)
    except BaseException:
        _forward_failed(tree, unit)
        raise
    return _after_forward(tree, unit, out, grad_on)


@torch.compiler.disable  # type: ignore[untyped-decorator]  # unannotated in torch
def _before_forward(
    tree: Tree, unit: int, args: tuple[Any, ...], kwargs: dict[str, Any], grad_on: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    h = tree.handles[unit]
    with tree.log.during(Phase.FORWARD), _waiting(tree, unit, "forward"):
        if unit == tree.root:
            _begin_iteration(tree, grad_on)
        args, kwargs = _cast_inputs(tree, unit, args, kwargs)
        if h is not None:
            if unit != tree.root:
                _sequence(tree, HookEvent(Event.PRE_FORWARD, unit), grad_on)
            if grad_on:
                tree.unshard.run(Event.PRE_FORWARD, unit)
            h.finish_unshard()
            h.use_unsharded_views()
    return args, kwargs


@torch.compiler.disable  # type: ignore[untyped-decorator]  # unannotated in torch
def _forward_failed(tree: Tree, unit: int) -> None:
    h = tree.handles[unit]
    if h is not None:
        h.restore_params()


@torch.compiler.disable  # type: ignore[untyped-decorator]  # unannotated in torch
def _after_forward(tree: Tree, unit: int, out: Any, grad_on: bool) -> Any:
    h = tree.handles[unit]
    with tree.log.during(Phase.FORWARD):
        try:
            if unit == tree.root:
                with _waiting(tree, unit, "end of forward"):
                    _sequence(tree, HookEvent(Event.END_FORWARD, -1), grad_on)
        finally:
            if h is not None:
                h.restore_params()
        if h is not None:
            with _waiting(tree, unit, "forward"):
                if grad_on:
                    tree.unshard.run(Event.POST_FORWARD, unit)
                else:
                    h.free_unsharded()
    if grad_on:
        for t in tensors_in(out):
            if t.requires_grad:
                t.register_hook(functools.partial(pre_backward, tree, unit))  # type: ignore[no-untyped-call]  # unannotated in torch
    return out


def _begin_iteration(tree: Tree, grad_on: bool) -> None:
    """The root's forward starts an iteration: the ranks agree (first time only), a backward that
    did not finish is dropped, gradients the user dropped are freed."""
    if not tree.first_forward_done:
        tree.agreement_seconds = check_agreement(tree)
        tree.first_forward_done = True
    if tree.iteration.unfinished:
        abandon_backward(tree)
    tree.runtime.settle()
    for h in tree.flat_handles:
        h.reclaim(at_forward=True)
    if grad_on:
        tree.unshard.begin_forward()


def _cast_inputs(
    tree: Tree, unit: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return cast_inputs(
        tree.options.mixed_precision, args, kwargs, has_params=tree.handles[unit] is not None, is_root=unit == tree.root
    )


# -- backward -----------------------------------------------------------------------------------


def pre_backward(tree: Tree, unit: int, grad: torch.Tensor) -> torch.Tensor:
    """A hook on unit ``unit``'s forward outputs: the first of a backward queues
    ``end_of_backward``; the unit's parameters are gathered before its gradient is computed."""
    it = tree.iteration
    if not it.backward_started:
        it.backward_started = True
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(end_of_backward, tree))
    if unit not in it.unsharded_for_backward and tree.handles[unit] is not None:
        with _waiting(tree, unit, "backward"):
            _sequence(tree, HookEvent(Event.PRE_BACKWARD, unit), True)
            _unshard_for_backward(tree, unit)
    return grad


def _unshard_for_backward(tree: Tree, unit: int) -> None:
    h = tree.handles[unit]
    assert h is not None
    tree.iteration.unsharded_for_backward.add(unit)
    with tree.log.during(Phase.PRE_BACKWARD):
        h.reclaim()
        tree.unshard.run(Event.PRE_BACKWARD, unit)
        h.finish_unshard()
    if tree.options.use_orig_params:
        h.use_unsharded_views()


def post_backward(tree_ref: weakref.ref[Tree], unit: int, flat_param: torch.Tensor) -> None:
    """The flat parameter's post-accumulate-grad hook: reduce its new gradient (``install``: the
    tree is held weakly; without it there is nothing to do)."""
    tree = tree_ref()
    if tree is None:
        return
    h = tree.handles[unit]
    assert h is not None and h.flat_param is flat_param
    if unit in tree.iteration.reduced_virtually:
        raise RankMismatchError(
            f"FSDP: unit {unit}'s gradient arrived on rank {dist.get_rank()} after the ranks had "
            "reduced it with a zero gradient here: the ranks' backward orders differ, not only which "
            "units they use"
        )
    with _waiting(tree, unit, "gradient reduction"):
        _sequence(tree, HookEvent(Event.POST_BACKWARD, unit), True)
        h.restore_params()
        _reduce(tree, unit, h.take_grad)


def _reduce(tree: Tree, unit: int, take_grad: Callable[[], torch.Tensor]) -> None:
    """Run the hook ops of unit ``unit``'s post-backward plan on its unsharded gradient, which
    ``take_grad`` gives straight to the plan run: no frame here holds it, so its memory goes
    back at the plan's ``Free`` of it, not when this returns."""
    h = tree.handles[unit]
    assert h is not None
    run = PlanRun(tree.step_plan(unit, h.carried.roles), tree.runtime, h, take_grad(), tree.settings.comm_hook)
    with tree.log.during(Phase.POST_BACKWARD):
        run.run_hook_ops()
        tree.iteration.runs.append((unit, run))
        tree.unshard.run(Event.POST_BACKWARD, unit)


def end_of_backward(tree: Tree) -> None:
    """The autograd engine's callback once backward is done: every plan's deferred ops, then every
    unit finished; a new iteration state; the all-gather schedule planned after the first."""
    with _waiting(tree, tree.root, "end of backward"):
        _sequence(tree, HookEvent(Event.END_BACKWARD, -1), True)
        it = tree.iteration
        try:
            with tree.log.during(Phase.END_OF_BACKWARD):
                for _, run in it.runs:
                    run.run_callback_ops()
                tree.runtime.settle()
        finally:
            # every unit finished: original parameters back; where no plan handed a gradient off,
            # ``.grad`` shown as it was; what no plan resharded freed, unless the strategy keeps
            # it for the next accumulation step
            sync = tree.settings.sync_gradients
            reshard = tree.unshard.reshards_after_backward[sync]
            handed_off = {unit for unit, run in it.runs if run.done}
            for unit, h in enumerate(tree.handles):
                if h is None:
                    continue
                h.restore_params()
                if unit not in handed_off:
                    h.expose()
                if reshard:
                    h.free_unsharded()
            tree.iteration = IterationState()
        tree.unshard.end_backward(sync_gradients=sync)


def abandon_backward(tree: Tree) -> None:
    """The previous backward did not finish (an exception in a hook, or in the user's code
    between backward's start and its end): drop its half-done work, as FSDP1's root forward
    does, so this step starts clean. Gradients it had not finished are lost, as they are in
    FSDP1; those handed to the optimizer before stay."""
    it, tree.iteration = tree.iteration, IterationState()
    with contextlib.suppress(RuntimeError):
        tree.runtime.drain()
    for unit, h in enumerate(tree.handles):
        if h is None:
            continue
        h.restore_params()
        if unit in it.unsharded_for_backward:
            h.flat_param.grad = None
        h.free_unsharded()
        h.expose()


# -- ranks that agree on every event ------------------------------------------------------------


def _sequence(tree: Tree, event: HookEvent, grad_on: bool) -> None:
    """With ``ranks_may_diverge``: agree with the other ranks that ``event`` is next here,
    running first (virtually) every earlier event another rank is at. Without: record it, and at
    the end of backward check that every rank ran the same events."""
    sequencer = tree.sequencer
    if sequencer is None:
        if grad_on:
            tree.iteration.events.append(event)
        if event.event is Event.END_BACKWARD:
            check_same_events(tree, tree.iteration.events)
        return
    while (decided := sequencer.agree(event)) != event:
        run_virtually(tree, decided, grad_on)


def run_virtually(tree: Tree, event: HookEvent, grad_on: bool) -> None:
    """An event other ranks run and this one would skip: the same collectives, with nothing
    computed (a zero gradient for the reduction)."""
    unit = event.unit
    h = tree.handles[unit]
    assert h is not None
    match event.event:
        case Event.PRE_FORWARD:
            if grad_on:
                tree.unshard.run(Event.PRE_FORWARD, unit)
            h.finish_unshard()
            if grad_on:
                tree.unshard.run(Event.POST_FORWARD, unit)
            else:
                h.free_unsharded()
        case Event.PRE_BACKWARD:
            if unit not in tree.iteration.unsharded_for_backward:
                _unshard_for_backward(tree, unit)
        case Event.POST_BACKWARD:
            if unit not in tree.iteration.unsharded_for_backward:
                _unshard_for_backward(tree, unit)
            h.restore_params()
            tree.iteration.reduced_virtually.add(unit)
            _reduce(
                tree,
                unit,
                lambda: torch.zeros(h.layout.total_numel, dtype=h.flat_param.dtype, device=h.flat_param.device),
            )
        case Event.POST_FORWARD | Event.END_FORWARD | Event.END_BACKWARD:
            raise AssertionError(f"{event.event.value} is never run virtually")
        case _:
            assert_never(event.event)


# -- helpers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _waiting(tree: Tree, unit: int, step: str) -> Iterator[None]:
    """One FSDP step of ``unit``: a range ``fsdp::<step> unit <n>`` in a ``torch.profiler`` trace
    (so Perfetto tells one unit's collectives from another's), and a backend's timeout in it
    translated to ``CollectiveTimeoutError``."""
    label = f"fsdp::{step} unit {unit}" if unit >= 0 else f"fsdp::{step}"
    with torch.profiler.record_function(label):
        try:
            yield
        except RuntimeError as error:
            timeout = timeout_error(error, step, functools.partial(tree.where, unit), tree.options.ranks_may_diverge)
            if timeout is None:
                raise
            raise timeout from error
