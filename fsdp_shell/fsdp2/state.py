"""The state behind ``fully_shard``: one ``FSDPState`` per call, one ``RootContext`` per root, and
the hooks of one iteration.

- Forward (each module's pre- and post-forward hooks): the root's first forward builds the
  context (every ``fully_shard`` state under it, the runtime, the verifying plan cache, the
  all-gather schedule); every module gathers its parameters, runs on the unsharded ones,
  reshards after forward as ``reshard_after_forward`` says (by default every module but the
  root; an int: to groups of that many ranks), and hooks its outputs. What each hook gathers,
  prefetches and reshards is the verified all-gather schedule's (``fsdp_shell.fsdp2.gathers``).
- Backward: a hook on those outputs gathers again where the forward resharded (unless
  ``set_unshard_in_backward(False)``), and the first queues the end of backward on the autograd
  engine. Once autograd has accumulated the gradient of every trainable unsharded parameter of a
  unit and computed its forward inputs' gradients, the unit's post-backward plan (the planner's,
  for its reduce layout and this step's flags) runs under the interpreter on the runtime.
- Explicit prefetch lists issue other units' all-gathers after a unit's own; each is waited for
  at its own unit's hook. Every collective section is a profiler range named by step and unit,
  where a backend that gives up on the other ranks becomes a ``CollectiveTimeoutError``.
- End of backward: units whose gradients did not all arrive are reduced with zeros for the
  missing ones (none of them arrived: not reduced, as in FSDP2), every plan's deferred ops run,
  and the units reshard as ``reshard_after_backward`` says.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core import (
    Event,
    InputRole,
    Plan,
    PlanCache,
    PlanRequest,
)
from fsdp_shell.fsdp2.gathers import GatherRunner
from fsdp_shell.fsdp2.group import ParamGroup
from fsdp_shell.fsdp2.units import Settings, cast_floats, per_param_request, reshards_after_forward
from fsdp_shell.runtime.collectives import CollectiveLog, Phase
from fsdp_shell.runtime.device import make_runtime
from fsdp_shell.runtime.groups import ProcessGroups
from fsdp_shell.runtime.interpreter import PlanRun
from fsdp_shell.runtime.protocol import Runtime
from fsdp_shell.safety.timeouts import timeout_error
from fsdp_shell.units.forward_io import tensors_in

__all__ = [
    "FSDPState",
    "RootContext",
    "Settings",
    "state_of",
]

STATE_ATTR = "_fsdp_shell_state"


@dataclass
class _Iteration:
    """One forward and backward of a root."""

    backward_started: bool = False
    prepared: set[int] = field(default_factory=set)
    """States (by ``id``) gathered for this backward."""
    reduced: set[int] = field(default_factory=set)
    """States whose post-backward ran."""
    arrived: dict[int, int] = field(default_factory=dict)
    """Per state, how many of its parameters' gradients autograd has accumulated."""
    inputs_pending: dict[int, int] = field(default_factory=dict)
    """Per state, how many of its forward inputs' gradients autograd has still to compute (a
    frozen parameter may be needed for them after the last trainable one's gradient)."""
    runs: list[PlanRun] = field(default_factory=list)


class FSDPState:
    """One ``fully_shard`` call: its modules, its parameters (``group``; None without any), its
    mixed-precision policy and settings."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: ParamGroup | None,
        mesh: DeviceMesh,
        mp: MixedPrecisionPolicy,
        *,
        offload: bool = False,
        post_forward_mesh: DeviceMesh | None = None,
    ) -> None:
        self.modules = modules
        self.group = group
        self.mesh = mesh
        self.post_forward_mesh = post_forward_mesh
        """``reshard_after_forward`` an int: the 1-D mesh of this rank's group of that many ranks,
        over which backward gathers the unit it resharded to after forward."""
        self.mp = mp
        self.offload = offload
        kinds = "+".join(type(m).__name__ for m in modules)
        held = "" if group is None else f" (holding {', '.join(p.name for p in group.layout.params[:2])})"
        self.name = f"the unit of {kinds}{held}"
        """The unit for people, in messages and profiler ranges."""
        """``CPUOffloadPolicy``: the reduced gradient is handed off on the host (the plan's
        ``Offload``; on a CPU mesh the device is the host, so nothing is copied)."""
        self.settings = Settings()
        self.post_optim_event: torch.Event | None = None
        """``set_post_optim_event``'s, on a root: waited for at its next forward, then dropped."""
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        """``set_all_reduce_hook``'s: called on the reduced gradient by the plan's hook op."""
        self.forward_prefetch: tuple[FSDPState, ...] = ()
        """Units whose all-gather this one's pre-forward issues after its own
        (``set_modules_to_forward_prefetch``)."""
        self.backward_prefetch: tuple[FSDPState, ...] = ()
        """Units whose all-gather this one's pre-backward issues after its own
        (``set_modules_to_backward_prefetch``)."""
        self._plans: dict[frozenset[InputRole], Plan] = {}
        """This step's plan by the roles the unit carries, under the settings in force (emptied
        when they change), so a backward looks its plan up without building a request."""
        self.ctx: RootContext | None = None
        self.is_root = False
        self.runtime: Runtime | None = None
        """Where the unit's collectives and plans run (its root's, for its mesh; set at lazy init)."""
        self.post_forward_runtime: Runtime | None = None
        """The runtime of ``post_forward_mesh`` (set at lazy init where there is one)."""
        if group is not None:
            group.hook_grads(functools.partial(_arrived, weakref.ref(self)))
        if group is not None:
            for holder in group.holders:  # state dicts see the sharded DTensor parameters
                to_sharded = functools.partial(_to_sharded, group)
                holder.register_state_dict_pre_hook(to_sharded)  # type: ignore[no-untyped-call]  # unannotated in torch
                holder.register_load_state_dict_pre_hook(to_sharded)  # type: ignore[no-untyped-call]  # unannotated in torch
        for module in modules:
            module.__dict__[STATE_ATTR] = self
            module.register_forward_pre_hook(functools.partial(_pre_forward, self), prepend=True, with_kwargs=True)
            module.register_forward_hook(functools.partial(_post_forward, self), always_call=False, with_kwargs=True)

    def change(self, **changes: Any) -> None:
        """Replace the settings (``FSDPModule``'s setters)."""
        self.settings = replace(self.settings, **changes)
        self._plans = {}

    def change_hook(self, hook: Callable[[torch.Tensor], None]) -> None:
        """Set the all-reduce hook (the plans then call it)."""
        self.all_reduce_hook = hook
        self._plans = {}

    def step_plan(self, roles: frozenset[InputRole]) -> Plan:
        """The unit's post-backward plan this step, given the roles it carries: from the root's
        verifying cache the first time, one dictionary lookup after."""
        plan = self._plans.get(roles)
        if plan is None:
            assert self.ctx is not None
            plan = self._plans[roles] = self.ctx.plans(self.request(roles))
        return plan

    @property
    def reshards_after_forward(self) -> bool:
        return reshards_after_forward(self.settings.reshard_after_forward, self.is_root)

    @property
    def reshards_after_backward(self) -> bool:
        return self.settings.reshard_after_backward

    @property
    def gathers_for_backward(self) -> bool:
        return self.settings.unshard_in_backward

    @property
    def forward_prefetches(self) -> tuple[FSDPState, ...]:
        return self.forward_prefetch

    @property
    def backward_prefetches(self) -> tuple[FSDPState, ...]:
        return self.backward_prefetch

    @property
    def post_forward_size(self) -> int | None:
        """The size of the groups the unit reshards to after forward, where not the shard group."""
        value = self.settings.reshard_after_forward
        return None if value is None or isinstance(value, bool) else value

    def request(self, roles: frozenset[InputRole]) -> PlanRequest:
        """The plan request of this unit's post-backward with the carried ``roles``."""
        group = self.group
        assert group is not None and group.reduce_layout is not None and self.ctx is not None
        return per_param_request(
            group.reduce_layout,
            replicate_size=self.mesh.size(0) if self.mesh.ndim == 2 else None,
            rank=group.rank,
            mp=self.mp,
            offload=self.offload,
            caps=self.ctx.groups(self.mesh).caps,
            settings=self.settings,
            roles=roles,
            all_reduce_hook=self.all_reduce_hook is not None,
        )


def _to_sharded(group: ParamGroup, *args: Any, **kwargs: Any) -> None:
    group.to_sharded()


def _runtime(state: FSDPState) -> Runtime:
    assert state.runtime is not None, "a state's runtime is set at its root's lazy init"
    return state.runtime


def state_of(module: nn.Module) -> FSDPState | None:
    """The ``fully_shard`` state of ``module``, if it was given to ``fully_shard``."""
    value = module.__dict__.get(STATE_ATTR)
    return value if isinstance(value, FSDPState) else None


class RootContext:
    """What every ``fully_shard`` state under one root shares: the runtime and its collective log,
    the verifying plan cache, and the iteration in progress."""

    def __init__(self, root: FSDPState, states: list[FSDPState]) -> None:
        self.root = root
        self.states = states
        self.log = CollectiveLog()
        self.plans = PlanCache(verify=True)
        self.iteration = _Iteration()
        self._runtimes: dict[tuple[int, int, str], tuple[ProcessGroups, Runtime]] = {}
        self.all_runtimes: list[Runtime] = []
        """Every runtime of the root's meshes (``runtimes``, fixed at lazy init)."""
        self.gathers: GatherRunner
        """The units' all-gathers, from the verified schedule (made at lazy init)."""

    def groups(self, mesh: DeviceMesh) -> ProcessGroups:
        return self._entry(mesh)[0]

    def runtime(self, mesh: DeviceMesh) -> Runtime:
        return self._entry(mesh)[1]

    def _entry(self, mesh: DeviceMesh) -> tuple[ProcessGroups, Runtime]:
        """The groups and runtime of ``mesh``: one runtime per pair of process groups, however
        many mesh objects name them (``fully_shard`` calls without a mesh each make one)."""
        if mesh.ndim == 1:
            groups = ProcessGroups(shard=mesh.get_group(0), replicate=None)
        else:
            groups = ProcessGroups(shard=mesh.get_group(1), replicate=mesh.get_group(0))
        key = (id(groups.shard), id(groups.replicate), mesh.device_type)
        entry = self._runtimes.get(key)
        if entry is None:
            device = torch.device(mesh.device_type) if mesh.device_type == "cpu" else _current(mesh.device_type)
            entry = self._runtimes[key] = (groups, make_runtime(device, groups, self.log))
        return entry

    @property
    def runtimes(self) -> list[Runtime]:
        """Every runtime of the root's meshes."""
        return [r for _, r in self._runtimes.values()]


def _current(device_type: str) -> torch.device:  # pragma: no cover  (needs an accelerator)
    return torch.device(device_type, torch.accelerator.current_device_index())


# -- lazy initialization ------------------------------------------------------------------------


def lazy_init(state: FSDPState) -> RootContext:
    """The context of the root ``state``: every ``fully_shard`` state under its modules, built at
    its first forward (a state already under another root stays there)."""
    if state.ctx is not None:
        return state.ctx
    states: list[FSDPState] = []
    for module in state.modules:
        for m in module.modules():
            s = state_of(m)
            if s is not None and s not in states and s.ctx is None:
                states.append(s)
    ctx = RootContext(state, states)
    for s in states:
        s.ctx = ctx
        s.is_root = s is state
        s.runtime = ctx.runtime(s.mesh)
        if s.post_forward_mesh is not None:
            s.post_forward_runtime = ctx.runtime(s.post_forward_mesh)
        if s.group is not None:
            s.group.materialize()
    ctx.all_runtimes = ctx.runtimes
    ctx.gathers = GatherRunner(states, state)
    return ctx


# -- forward --------------------------------------------------------------------------------------


@torch.compiler.disable  # type: ignore[untyped-decorator]  # unannotated in torch
def _pre_forward(
    state: FSDPState, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    ctx = lazy_init(state)
    if state.is_root:
        _begin_iteration(ctx)
        ctx.gathers.begin_iteration()
    if state.mp.cast_forward_inputs:
        args, kwargs = cast_floats(state.mp.param_dtype, (args, kwargs))
    with ctx.log.during(Phase.FORWARD), _waiting(state, "forward"):
        ctx.gathers.run(Event.PRE_FORWARD, state)
    group = state.group
    if group is not None:
        group.use_unsharded()
        if torch.is_grad_enabled() and group.grad_index:
            _hook_inputs(state, ctx, (args, kwargs))
    return args, kwargs


_CAUSES = (
    "a rank stopped, died or is still busy, or the ranks' models took different paths (fully_shard needs "
    "every rank to run the same modules, each with its output used)"
)


@contextlib.contextmanager
def _waiting(state: FSDPState, step: str) -> Iterator[None]:
    """One FSDP step of ``state``'s unit: a range ``fsdp::<step> <unit>`` in a ``torch.profiler``
    trace, and a backend that gives up on the other ranks turned into a
    ``CollectiveTimeoutError`` naming the step and unit (``fsdp_shell.safety.timeouts``)."""
    with torch.profiler.record_function(f"fsdp::{step} {state.name}"):
        try:
            yield
        except RuntimeError as error:
            timeout = timeout_error(error, step, lambda: state.name, False, causes=_CAUSES)
            if timeout is None:
                raise
            raise timeout from error


def _hook_inputs(state: FSDPState, ctx: RootContext, inputs: Any) -> None:
    """Count the forward inputs whose gradients backward computes: the unit's post-backward waits
    for them too, so no parameter is freed while backward still reads it."""
    hooked = [t for t in tensors_in(inputs) if t.requires_grad]
    it = ctx.iteration
    it.inputs_pending[id(state)] = it.inputs_pending.get(id(state), 0) + len(hooked)
    hook = functools.partial(_input_done, weakref.ref(state))
    for t in hooked:
        t.register_hook(hook)  # type: ignore[no-untyped-call]  # unannotated in torch


@torch.compiler.disable  # type: ignore[untyped-decorator]  # unannotated in torch
def _post_forward(state: FSDPState, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    if state.ctx is not None:
        state.ctx.gathers.run(Event.POST_FORWARD, state)
    if state.group is not None and torch.is_grad_enabled():
        hook = functools.partial(_pre_backward, weakref.ref(state))
        for t in tensors_in(out):
            if t.requires_grad:
                t.register_hook(hook)  # type: ignore[no-untyped-call]  # unannotated in torch
    return cast_floats(state.mp.output_dtype, out)


def _begin_iteration(ctx: RootContext) -> None:
    """The root's forward: a backward that did not finish is dropped; work still in flight is
    waited for."""
    if ctx.iteration.backward_started:
        abandon_backward(ctx)
    for runtime in ctx.all_runtimes:
        runtime.settle()
    event, ctx.root.post_optim_event = ctx.root.post_optim_event, None
    if event is not None and event.device.type != "cpu":  # pragma: no cover  (needs an accelerator)
        event.wait()  # the current stream, where the all-gathers are issued, waits for the step


# -- backward -----------------------------------------------------------------------------------


def _pre_backward(state_ref: weakref.ref[FSDPState], grad: torch.Tensor) -> torch.Tensor:
    state = state_ref()
    if state is None or state.ctx is None:
        return grad
    ctx, group = state.ctx, state.group
    it = ctx.iteration
    if not it.backward_started:
        it.backward_started = True
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(end_of_backward, ctx))
    if group is not None and id(state) not in it.prepared:
        it.prepared.add(id(state))
        with ctx.log.during(Phase.PRE_BACKWARD), _waiting(state, "backward"):
            ctx.gathers.run(Event.PRE_BACKWARD, state)
        group.use_unsharded()
        group.restore_pending()
    return grad


def _arrived(state_ref: weakref.ref[FSDPState], param: torch.Tensor) -> None:
    """An unsharded parameter's gradient is accumulated."""
    state = state_ref()
    if state is None or state.ctx is None or state.group is None:
        return
    it = state.ctx.iteration
    it.arrived[id(state)] = it.arrived.get(id(state), 0) + 1
    _maybe_reduce(state)


def _input_done(state_ref: weakref.ref[FSDPState], grad: torch.Tensor) -> torch.Tensor:
    """A forward input's gradient is computed."""
    state = state_ref()
    if state is not None and state.ctx is not None:
        it = state.ctx.iteration
        it.inputs_pending[id(state)] = it.inputs_pending.get(id(state), 0) - 1
        _maybe_reduce(state)
    return grad


def _maybe_reduce(state: FSDPState) -> None:
    """The unit reduces once every trainable parameter's gradient has arrived and no forward
    input's gradient is still to come."""
    assert state.ctx is not None and state.group is not None
    it = state.ctx.iteration
    key = id(state)
    if it.arrived.get(key, 0) == len(state.group.grad_index) and it.inputs_pending.get(key, 0) <= 0:
        post_backward(state)


def post_backward(state: FSDPState) -> None:
    """Reduce the unit's gradients: its plan for this step's flags, hook ops now."""
    ctx, group = state.ctx, state.group
    assert ctx is not None and group is not None
    it = ctx.iteration
    if id(state) in it.reduced:
        return
    it.reduced.add(id(state))
    group.reclaim()
    plan = state.step_plan(frozenset(group.carried))
    run = PlanRun(plan, _runtime(state), group, group.take_grads(), all_reduce_hook=state.all_reduce_hook)
    group.use_sharded()
    with ctx.log.during(Phase.POST_BACKWARD), _waiting(state, "gradient reduction"):
        run.run_hook_ops()
        ctx.gathers.run(Event.POST_BACKWARD, state)
    it.runs.append(run)


def end_of_backward(ctx: RootContext) -> None:
    """Autograd's callback once backward is done: units with some gradients missing are reduced
    now (zeros for the missing), every plan's deferred ops run, every unit reshards as
    ``reshard_after_backward`` says."""
    it = ctx.iteration
    try:
        for state in reversed(ctx.states):
            group = state.group
            if group is not None and id(state) not in it.reduced and group.has_grads:
                post_backward(state)
        with ctx.log.during(Phase.END_OF_BACKWARD), _waiting(ctx.root, "end of backward"):
            for run in it.runs:
                run.run_callback_ops()
            for runtime in ctx.all_runtimes:
                runtime.settle()
    finally:
        for state in ctx.states:
            group = state.group
            if group is None:
                continue
            if state.settings.reshard_after_backward:
                group.free_unsharded()
            group.use_sharded()
        ctx.gathers.end_backward()
        ctx.iteration = _Iteration()


def abandon_backward(ctx: RootContext) -> None:
    """The previous backward did not finish: its half-done work is dropped, every unit resharded."""
    ctx.iteration = _Iteration()
    for runtime in ctx.all_runtimes:
        with contextlib.suppress(RuntimeError):
            runtime.drain()
    for state in ctx.states:
        if state.group is not None:
            for i in state.group.grad_index:
                state.group.unsharded[i].grad = None
            state.group.free_unsharded()
            state.group.use_sharded()
