"""Every rank's plan of a world, run in one process under the interpreter that trains.

``simulate(request, grads, ...)`` builds the plan of every rank of a ``replicate x shard`` world
and runs each under ``runtime.interpreter.PlanRun`` (the interpreter the training hooks use), on
a thread of its own, with an ``InProcessRuntime`` (``runtime.inprocess``) whose process groups
meet in this process. Communication hooks are the library's own (``fsdp_shell.comm_hooks``),
bound as ``FSDP.register_comm_hook`` binds them. No op is given a meaning here: what an op does
is the interpreter's, what a hook does is the hook's, what a collective computes is the
world's. It exists to show, with numbers, that a plan hands each rank exactly its shard of the
averaged gradient; the ranks' geometry and arithmetic are ``runtime.inprocess``'s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from fsdp_core import (
    Buffer,
    CommHook,
    Destination,
    Group,
    Input,
    InputRole,
    PerParamLayout,
    Plan,
    PlanRequest,
    ShardView,
    build_plan,
)
from fsdp_shell import comm_hooks
from fsdp_shell.runtime.inprocess import (
    InProcessRuntime,
    InProcessWorld,
    Issued,
    SimulationError,
    WorldAborted,
    WorldGeometry,
)
from fsdp_shell.runtime.interpreter import CommHookFn, PlanRun
from fsdp_shell.units.grads import Grads, parts

__all__ = [
    "HOOKS",
    "GradView",
    "HookCall",
    "Issued",
    "RankResult",
    "SimulationError",
    "WorldGeometry",
    "WorldResult",
    "simulate",
    "user_hook",
]

Planner = Callable[[PlanRequest], Plan]
"""Builds one rank's plan; ``simulate`` takes one so that tests can run altered plans."""

# -- one rank's owner: what the plan hands back --------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class GradView:
    """A ``GradViews`` entry: ``tensor`` (a 1-D view into the viewed buffer) holds the elements
    ``[offset_in_param, offset_in_param + tensor.numel())`` of the flattened parameter."""

    param_name: str
    offset_in_param: int
    tensor: Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class HookCall:
    """One call of a communication hook, as one rank's hook state saw it."""

    hook: CommHook
    members: tuple[int, ...]
    """Global ranks of the group it reduced over."""
    pre: float
    """What its state divides by before reducing."""
    post: float
    """What its state divides by after reducing."""


def user_hook(state: comm_hooks.HookState, grad: Tensor, output: Tensor | None = None) -> None:
    """Stands for a user's hook (the plans call it ``USER``): ``reduce_scatter_hook``'s contract."""
    comm_hooks.reduce_scatter_hook(state, grad, output)


HOOKS: Mapping[CommHook, Callable[..., None]] = {
    CommHook.ALLREDUCE: comm_hooks.allreduce_hook,
    CommHook.REDUCE_SCATTER: comm_hooks.reduce_scatter_hook,
    CommHook.FP16_COMPRESS: comm_hooks.fp16_compress_hook,
    CommHook.BF16_COMPRESS: comm_hooks.bf16_compress_hook,
    CommHook.USER: user_hook,
}
"""The hook ``simulate`` registers for each kind the plans name."""


class _Owner:
    """One rank's ``PlanOwner``: gives the run its carried inputs and keeps what it hands back."""

    def __init__(self, rank: int, carried: Mapping[InputRole, Grads]) -> None:
        self._rank = rank
        self._carried = dict(carried)
        self.freed = False
        self.views: list[GradView] = []
        self.handed: tuple[Buffer, Tensor, Destination] | None = None

    def free_unsharded(self) -> None:
        if self.freed:
            raise SimulationError(f"rank {self._rank}: the unsharded parameter is freed twice")
        self.freed = True

    def expose_views(self, value: Grads, views: tuple[ShardView, ...]) -> None:
        grad = _end_to_end(value)
        for v in views:
            if v.offset_in_buffer < 0 or v.offset_in_buffer + v.numel > grad.numel():
                raise SimulationError(f"rank {self._rank}: the view of {v.param_name} lies outside its buffer")
            tensor = grad.narrow(0, v.offset_in_buffer, v.numel)
            self.views.append(GradView(param_name=v.param_name, offset_in_param=v.offset_in_param, tensor=tensor))

    def take_carried(self, role: InputRole) -> Grads:
        return self._carried.pop(role)

    def hand_off(self, plan: Plan, value: Grads) -> None:
        if self.handed is not None or plan.hand_off is None:
            raise SimulationError(f"rank {self._rank}: a hand-off the plan does not declare once")
        self.handed = (plan.hand_off.buffer, _end_to_end(value), plan.hand_off.destination)

    def host_grad_buffer(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype)


def _end_to_end(value: Grads) -> Tensor:
    """One tensor: a per-parameter unit's unsharded gradients flattened and laid end to end (a
    copy), as the plan's buffer declares them."""
    return torch.cat([t.reshape(-1) for t in parts(value)]) if isinstance(value, tuple) else value


# -- the world's run -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RankResult:
    """What one rank's plan left behind."""

    rank: int
    """Global rank."""
    plan: Plan
    """The plan this rank ran (its request's ``sharding.rank`` is the rank's shard rank)."""
    grad: Tensor | None
    """The handed-off tensor, or None when the plan hands nothing off."""
    buffer: Buffer | None
    """The handed-off buffer as the plan declares it (its ``device`` says HOST or DEVICE)."""
    destination: Destination | None
    views: tuple[GradView, ...]
    """The ``GradViews`` it exposed (``use_orig_params``), in parameter order."""
    hook_calls: tuple[HookCall, ...]
    """Every communication hook call it took part in."""
    issued: tuple[Issued, ...]
    """Every collective and hook call its runtime issued, in order."""
    unsharded_param_freed: bool
    """Whether the plan resharded (``FreeUnshardedParam``)."""
    live_buffers: tuple[str, ...]
    """Buffers the run still held at the end (none, when the plan freed or handed off each)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldResult:
    """Every rank's result, indexed by global rank."""

    request: PlanRequest
    geometry: WorldGeometry
    ranks: tuple[RankResult, ...]

    @property
    def grads(self) -> tuple[Tensor, ...]:
        """Each rank's handed-off tensor; raises ``SimulationError`` if a rank handed none off."""
        out: list[Tensor] = []
        for r in self.ranks:
            if r.grad is None:
                raise SimulationError(f"rank {r.rank}: the plan handed no gradient off")
            out.append(r.grad)
        return tuple(out)


def simulate(
    request: PlanRequest,
    grads: Sequence[Tensor],
    *,
    pending_unsharded: Sequence[Tensor] | None = None,
    sharded_grads: Sequence[Tensor] | None = None,
    partials: Sequence[Tensor] | None = None,
    planner: Planner = build_plan,
    hooks: Mapping[CommHook, Callable[..., None]] = HOOKS,
) -> WorldResult:
    """Run ``request``'s plan on every rank of its world and return what each rank handed off.

    Every sequence is indexed by global rank and must have one tensor per rank of the world
    (``request.sharding.data_parallel_size``). ``grads[g]`` is rank ``g``'s unsharded flat
    gradient (``layout.total_numel`` elements of the compute dtype; for a per-parameter unit its
    parameters' gradients flattened end to end, which the run receives one tensor per parameter); ``pending_unsharded``,
    ``sharded_grads`` and ``partials`` feed the plan's ``PENDING_UNSHARDED``, ``SHARDED_GRAD`` and
    ``PENDING_PARTIAL`` inputs and must be given exactly when the plan takes them. Each input
    tensor must match its declared buffer in numel and dtype; it is copied, never modified.
    ``request.sharding.rank`` is ignored: rank ``g`` plans with its own shard rank. A plan with a
    comm hook calls ``hooks[kind]`` with a ``comm_hooks.DefaultState`` of the rank's shard group.

    Raises ``SimulationError`` when the plans cannot run (see that class).
    """
    geometry = WorldGeometry(shard_size=request.sharding.shard_size, replicate_size=request.sharding.replicate_size)
    supplied = {
        InputRole.GRAD: grads,
        InputRole.PENDING_UNSHARDED: pending_unsharded,
        InputRole.SHARDED_GRAD: sharded_grads,
        InputRole.PENDING_PARTIAL: partials,
    }
    inputs: dict[InputRole, Sequence[Tensor]] = {}
    for role, tensors in supplied.items():
        if tensors is None:
            continue
        if len(tensors) != geometry.world_size:
            raise SimulationError(
                f"{role.value}: expected one tensor per rank ({geometry.world_size}), got {len(tensors)}"
            )
        inputs[role] = tensors
    plans = tuple(
        planner(replace(request, sharding=request.sharding.with_rank(geometry.shard_rank(g))))
        for g in range(geometry.world_size)
    )
    bound = [_inputs(g, plan, inputs) for g, plan in enumerate(plans)]
    world = InProcessWorld(geometry)
    ranks: list[RankResult | None] = [None] * geometry.world_size

    def rank_main(g: int) -> None:
        try:
            ranks[g] = _run_rank(world, g, plans[g], bound[g], hooks)
        except BaseException as error:  # noqa: BLE001  # reported by simulate, on the caller's thread
            world.fail(g, error)

    threads = [threading.Thread(target=rank_main, args=(g,), name=f"rank-{g}") for g in range(geometry.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    own = [(g, e) for g, e in world.failures if not isinstance(e, WorldAborted)]
    if own or world.failures:
        g, error = (own or world.failures)[0]
        if isinstance(error, RuntimeError) and not isinstance(error, SimulationError):
            raise SimulationError(f"rank {g}: {error}") from error
        raise error
    return WorldResult(request=request, geometry=geometry, ranks=tuple(r for r in ranks if r is not None))


def _inputs(rank: int, plan: Plan, inputs: Mapping[InputRole, Sequence[Tensor]]) -> dict[InputRole, Grads]:
    """Rank ``rank``'s copy of each input ``plan`` takes, checked against its declared buffer: a
    per-parameter unit's unsharded gradients as one tensor per parameter, in its shape."""
    out: dict[InputRole, Grads] = {}
    layout = plan.request.layout
    for op in plan.ops:
        if not isinstance(op, Input):
            continue
        tensors = inputs.get(op.role)
        if tensors is None:
            raise SimulationError(f"the plan takes a {op.role.value} input ({op.buffer}) that was not supplied")
        given = tensors[rank]
        if given.numel() != op.buffer.numel or given.dtype != op.buffer.dtype:
            raise SimulationError(
                f"rank {rank}: {op.role.value} input has {given.numel()} elements of {given.dtype}, "
                f"the plan declares {op.buffer}"
            )
        copied = given.detach().to("cpu").reshape(-1).clone()
        unsharded = op.role in (InputRole.GRAD, InputRole.PENDING_UNSHARDED)
        if isinstance(layout, PerParamLayout) and unsharded:
            pieces = torch.split(copied, [p.numel for p in layout.params])
            out[op.role] = tuple(t.clone().view(p.shape) for t, p in zip(pieces, layout.params))
        else:
            out[op.role] = copied
    unused = sorted(role.value for role in set(inputs) - set(out))
    if unused:
        raise SimulationError(f"inputs supplied but never taken by the plan: {', '.join(unused)}")
    return out


def _run_rank(
    world: InProcessWorld,
    rank: int,
    plan: Plan,
    inputs: dict[InputRole, Grads],
    hooks: Mapping[CommHook, Callable[..., None]],
) -> RankResult:
    """Rank ``rank``'s plan under the interpreter, on the calling thread."""
    groups = world.groups(rank)
    runtime = InProcessRuntime(groups)
    owner = _Owner(rank, {role: t for role, t in inputs.items() if role is not InputRole.GRAD})
    hook_calls: list[HookCall] = []
    bound: CommHookFn | None = None
    kind = plan.request.comm_hook
    if kind is not CommHook.NONE:
        state = comm_hooks.DefaultState(groups.shard)
        call, named = comm_hooks.bind(state, hooks[kind], plan.request.sharding.strategy)

        def bound(grad: Tensor, output: Tensor | None) -> None:
            hook_calls.append(
                HookCall(
                    hook=named,
                    members=world.geometry.members(rank, Group.SHARD),
                    pre=state.gradient_predivide_factor,
                    post=state.gradient_postdivide_factor,
                )
            )
            call(grad, output)

    run = PlanRun(plan, runtime, owner, inputs.get(InputRole.GRAD, torch.empty(0)), bound)
    run.run_hook_ops()
    run.run_callback_ops()
    buffer, grad, destination = owner.handed if owner.handed is not None else (None, None, None)
    return RankResult(
        rank=rank,
        plan=plan,
        grad=grad,
        buffer=buffer,
        destination=destination,
        views=tuple(owner.views),
        hook_calls=tuple(hook_calls),
        issued=tuple(runtime.issued),
        unsharded_param_freed=owner.freed,
        live_buffers=run.live,
    )
