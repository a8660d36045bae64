"""A world of N ranks in one process, running plans under the interpreter that trains.

``simulate(request, grads, ...)`` builds the plan of every rank of a ``replicate x shard`` world
and runs each under ``runtime.interpreter.PlanRun`` (the interpreter the training hooks use), on
a thread of its own, with an ``InProcessRuntime``: it runs each op on the rank's thread as it
comes, and issues collectives through the library's own entry points
(``runtime.collectives.reduce_scatter_flat`` / ``all_reduce_flat``) into ``InProcessGroup``, a
``torch.distributed.ProcessGroup`` whose members meet in this process. Communication hooks are
the library's own (``fsdp_shell.comm_hooks``), bound as ``FSDP.register_comm_hook`` binds them.
No op is given a meaning here: what an op does is the interpreter's, what a hook does is the
hook's, and this module supplies only ranks that meet. It exists to show, with numbers, that a
plan hands each rank exactly its shard of the averaged gradient.

Geometry is a 2-D mesh of shape ``(replicate, shard)``: global rank
``g = replicate_index * shard_size + shard_rank``. The shard group of ``g`` is the ranks with its
replicate index, ordered by shard rank; its replicate group is the ranks with its shard rank,
ordered by replicate index. ``NO_SHARD``'s shard group is the whole world.

Arithmetic: a reduction accumulates member by member, in group order, in float32 (float64 for
float64 tensors) and rounds once to the tensor's dtype, so float32 results do not depend on
thread timing. A real ring or tree reduction in float16/bfloat16 rounds after every step, so
low-precision results may differ from a real backend's in the last bits (ours being the more
accurate).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, assert_never

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # private, not stubbed
from torch.futures import Future

from fsdp_core import (
    Buffer,
    CommHook,
    Destination,
    Group,
    Input,
    InputRole,
    Plan,
    PlanRequest,
    ReduceOpSpec,
    ShardView,
    Stream,
    build_plan,
)
from fsdp_shell import comm_hooks
from fsdp_shell.runtime.collectives import all_gather_flat, all_reduce_flat, reduce_scatter_flat, to_reduce_op
from fsdp_shell.runtime.groups import ProcessGroups
from fsdp_shell.runtime.interpreter import CommHookFn, PlanRun
from fsdp_shell.runtime.protocol import Pending, Waitable

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "HOOKS",
    "GradView",
    "HookCall",
    "InProcessGroup",
    "InProcessRuntime",
    "InProcessWorld",
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

COLLECTIVE_TIMEOUT = 60.0
"""Seconds a rank waits for the rest of its group at a collective before the world fails."""


class SimulationError(RuntimeError):
    """A world that cannot run its plans: a buffer used before it exists or after it is freed; an
    input missing, unused or unlike its declared buffer; ranks whose collectives do not match or
    never meet."""


class _Aborted(SimulationError):
    """A rank stopped because another rank failed (not a failure of its own)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldGeometry:
    """The ranks of a ``(replicate, shard)`` mesh and their groups."""

    shard_size: int
    replicate_size: int

    @property
    def world_size(self) -> int:
        """Number of ranks: ``shard_size * replicate_size``."""
        return self.shard_size * self.replicate_size

    def shard_rank(self, rank: int) -> int:
        """Global ``rank``'s index in its shard group."""
        return rank % self.shard_size

    def replicate_index(self, rank: int) -> int:
        """Global ``rank``'s index in its replicate group (which replica it belongs to)."""
        return rank // self.shard_size

    def members(self, rank: int, group: Group) -> tuple[int, ...]:
        """The global ranks of ``rank``'s ``group``, ordered by their index in that group."""
        match group:
            case Group.SHARD:
                first = self.replicate_index(rank) * self.shard_size
                return tuple(range(first, first + self.shard_size))
            case Group.REPLICATE:
                return tuple(r * self.shard_size + self.shard_rank(rank) for r in range(self.replicate_size))
            case _:
                assert_never(group)


# -- ranks that meet -------------------------------------------------------------------------


@dataclass(slots=True)
class _Meeting:
    """One collective call of one group: what each member brought, and whether it is done."""

    arrived: dict[int, tuple[tuple[object, ...], Tensor, Tensor]] = field(default_factory=dict)
    """By position in the group: the call's signature, its input and its output."""
    done: bool = False
    error: SimulationError | None = None
    left: int = 0


class InProcessWorld:
    """The meeting place of a world's ranks: each group call completes when the last member
    reaches it, which computes every member's result. A failure on any rank (``fail``) releases
    every rank waiting at a collective."""

    def __init__(self, geometry: WorldGeometry, *, timeout: float = COLLECTIVE_TIMEOUT) -> None:
        self.geometry = geometry
        self._timeout = timeout
        self._cond = threading.Condition()
        self._meetings: dict[tuple[tuple[int, ...], int], _Meeting] = {}
        self.failures: list[tuple[int, BaseException]] = []

    def groups(self, rank: int) -> ProcessGroups:
        """Global ``rank``'s shard and replicate groups."""
        shard = InProcessGroup(self, self.geometry.members(rank, Group.SHARD), rank)
        replicate = InProcessGroup(self, self.geometry.members(rank, Group.REPLICATE), rank)
        return ProcessGroups(shard=shard, replicate=replicate)

    def fail(self, rank: int, error: BaseException) -> None:
        """``rank`` stopped with ``error``: wake every rank waiting at a collective."""
        with self._cond:
            self.failures.append((rank, error))
            self._cond.notify_all()

    def meet(
        self,
        members: tuple[int, ...],
        call: int,
        position: int,
        signature: tuple[object, ...],
        src: Tensor,
        dst: Tensor,
        land: _Land,
    ) -> None:
        """Member ``position`` of ``members`` reaches its ``call``-th collective on that group,
        bringing ``src`` and ``dst``; the last to arrive checks that all issued the same
        collective and runs ``land(srcs, dsts)`` in group order. Returns once it has."""
        with self._cond:
            meeting = self._meetings.setdefault((members, call), _Meeting())
            meeting.arrived[position] = (signature, src, dst)
            if len(meeting.arrived) == len(members):
                ordered = [meeting.arrived[p] for p in range(len(members))]
                if len({s for s, _, _ in ordered}) > 1:
                    meeting.error = SimulationError(
                        f"ranks {members} issue different collectives: {[s for s, _, _ in ordered]}"
                    )
                else:
                    land([s for _, s, _ in ordered], [d for _, _, d in ordered])
                meeting.done = True
                self._cond.notify_all()
            while not meeting.done:
                if self.failures:
                    raise _Aborted(f"rank {self.failures[0][0]} failed")
                if not self._cond.wait(self._timeout):
                    missing = sorted(members[p] for p in set(range(len(members))) - set(meeting.arrived))
                    raise SimulationError(
                        f"ranks {missing} never reached collective {call} of group {members} ({signature[0]})"
                    )
            meeting.left += 1
            if meeting.left == len(members):
                del self._meetings[(members, call)]
            if meeting.error is not None:
                raise meeting.error


_Land = Callable[[list[Tensor], list[Tensor]], None]
"""Completes a collective: every member's inputs and outputs, in group order."""


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduce(tensors: Sequence[Tensor], op: dist.ReduceOp) -> Tensor:
    """``op`` over ``tensors`` in order, accumulated in float32 (float64 for float64), in the
    accumulation dtype (the caller rounds once)."""
    acc = _accumulation_dtype(tensors[0].dtype)
    total = torch.zeros(tensors[0].shape, dtype=acc)
    kind = _kind(op)
    if kind == dist.ReduceOp.MAX:
        return torch.stack([t.to(acc) for t in tensors]).amax(0)
    scale = float(op.factor) if kind == dist.ReduceOp.PREMUL_SUM else 1.0
    if kind not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM):
        raise SimulationError(f"reduce op {kind} is not one the plans use")
    for t in tensors:
        total += t.to(acc) * scale if scale != 1.0 else t.to(acc)
    if kind == dist.ReduceOp.AVG:
        total /= len(tensors)
    return total


def _kind(op: dist.ReduceOp) -> object:
    kind: object = op.op  # type: ignore[attr-defined]  # a pybind attribute torch's stubs leave out
    return kind


def _describe(op: dist.ReduceOp) -> tuple[object, ...]:
    kind = _kind(op)
    return (kind, float(op.factor)) if kind == dist.ReduceOp.PREMUL_SUM else (kind,)


def _completed() -> dist.Work:
    """A ``Work`` that has completed and holds no tensor."""
    future: Future[None] = Future()
    future.set_result(None)
    work: dist.Work = _create_work_from_future(future)
    return work


class InProcessGroup(dist.ProcessGroup):
    """One rank's handle on a group of an ``InProcessWorld``: a ``torch.distributed``
    ``ProcessGroup``, so ``torch.distributed``'s functions (and this library's, and a user's
    comm hook) run on it unchanged. Each collective blocks until every member has issued it."""

    def __init__(self, world: InProcessWorld, members: tuple[int, ...], rank: int) -> None:
        super().__init__(members.index(rank), len(members))  # type: ignore[call-arg]  # stubs list only the store form
        self._world = world
        self.members = members
        """Global ranks, in group order."""
        self._position = members.index(rank)
        self._calls = 0

    def getBackendName(self) -> str:  # torch's name
        return "inprocess"

    def _meet(
        self,
        name: str,
        src: Tensor,
        dst: Tensor,
        op: tuple[object, ...],
        land: Callable[[list[Tensor], list[Tensor]], None],
    ) -> dist.Work:
        call, self._calls = self._calls, self._calls + 1
        signature = (name, *op, src.dtype, src.numel(), dst.numel())
        self._world.meet(self.members, call, self._position, signature, src, dst, land)
        return _completed()

    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]  # the form dist calls
        op = opts.reduceOp

        def land(srcs: list[Tensor], dsts: list[Tensor]) -> None:
            total = _reduce(srcs, op)
            for d in dsts:
                d.copy_(total)

        (tensor,) = tensors
        return self._meet("all_reduce", tensor, tensor, _describe(op), land)

    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:
        op, size = opts.reduceOp, len(self.members)
        if input.numel() != output.numel() * size or input.dtype != output.dtype:
            raise SimulationError(
                f"cannot reduce-scatter {input.numel()} x {input.dtype} "
                f"into {output.numel()} x {output.dtype} over {size} ranks"
            )

        def land(srcs: list[Tensor], dsts: list[Tensor]) -> None:
            total = _reduce([s.reshape(-1) for s in srcs], op)
            for d, chunk in zip(dsts, total.chunk(size)):
                d.reshape(-1).copy_(chunk)

        return self._meet("reduce_scatter", input, output, _describe(op), land)

    def all_gather_single(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:
        def land(srcs: list[Tensor], dsts: list[Tensor]) -> None:
            whole = torch.cat([s.reshape(-1) for s in srcs])
            for d in dsts:
                d.reshape(-1).copy_(whole)

        return self._meet("all_gather", input, output, (), land)


# -- one rank's runtime ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Issued:
    """One collective or comm hook call a rank's runtime issued."""

    kind: str
    """``reduce_scatter``, ``all_reduce`` or ``comm_hook``."""
    group: Group
    stream: Stream
    dtype: torch.dtype
    """What went over the wire (a hook's wire dtype)."""
    reduce_op: ReduceOpSpec | None
    """None for a comm hook, whose state divides."""


class _Done:
    def wait(self) -> None:
        return None


class InProcessRuntime:
    """A ``Runtime`` that runs each op on the calling thread as it comes, its collectives through
    ``runtime.collectives`` on ``groups`` (here an ``InProcessWorld``'s), and records each one
    issued. Nothing runs out of program order, so waits, stream records and frees are no-ops."""

    def __init__(self, groups: ProcessGroups) -> None:
        self._groups = groups
        self.issued: list[Issued] = []

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device, stream: Stream) -> Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype)

    def free(self, tensor: Tensor) -> None:
        return None

    def begin_plan(self) -> None:
        return None

    def compute(self, stream: Stream, work: Callable[[], object], uses: tuple[Tensor, ...]) -> None:
        work()

    def on_host(self, work: Callable[[], None], uses: tuple[Tensor, ...]) -> None:
        work()

    def reduce_scatter(
        self, stream: Stream, group: Group, dst: Tensor, src: Tensor, op: ReduceOpSpec, *, src_dies: bool
    ) -> None:
        self.issued.append(Issued(kind="reduce_scatter", group=group, stream=stream, dtype=src.dtype, reduce_op=op))
        reduce_scatter_flat(dst, src, self._groups.of(group), to_reduce_op(op))

    def all_reduce(self, stream: Stream, group: Group, tensor: Tensor, op: ReduceOpSpec) -> None:
        self.issued.append(Issued(kind="all_reduce", group=group, stream=stream, dtype=tensor.dtype, reduce_op=op))
        all_reduce_flat(tensor, self._groups.of(group), to_reduce_op(op))

    def comm_hook(
        self, stream: Stream, group: Group, call: Callable[[], None], src: Tensor, out: Tensor, wire_dtype: torch.dtype
    ) -> None:
        self.issued.append(Issued(kind="comm_hook", group=group, stream=stream, dtype=wire_dtype, reduce_op=None))
        call()

    def to_host(self, stream: Stream, src: Tensor, buffer: Callable[[], Tensor]) -> Tensor:
        if src.device.type == "cpu":
            return src
        dst = buffer()
        dst.copy_(src)
        return dst

    def wait_stream(self, stream: Stream, waits_for: Stream) -> None:
        return None

    def end_of_backward(self, stream: Stream, waits_for: Stream) -> None:
        return None

    def record_stream(self, tensor: Tensor, stream: Stream) -> None:
        return None

    def drain(self) -> None:
        return None

    def settle(self) -> None:
        return None

    def free_marker(self) -> Waitable:
        return _Done()

    def all_gather(self, out: Tensor, src: Tensor) -> Pending | None:
        all_gather_flat(out, src, self._groups.gather_group)
        return None


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

    def __init__(self, rank: int, carried: Mapping[InputRole, Tensor]) -> None:
        self._rank = rank
        self._carried = dict(carried)
        self.freed = False
        self.views: list[GradView] = []
        self.handed: tuple[Buffer, Tensor, Destination] | None = None

    def free_unsharded(self) -> None:
        if self.freed:
            raise SimulationError(f"rank {self._rank}: the unsharded parameter is freed twice")
        self.freed = True

    def expose_views(self, grad: Tensor, views: tuple[ShardView, ...]) -> None:
        for v in views:
            if v.offset_in_buffer < 0 or v.offset_in_buffer + v.numel > grad.numel():
                raise SimulationError(f"rank {self._rank}: the view of {v.param_name} lies outside its buffer")
            tensor = grad.narrow(0, v.offset_in_buffer, v.numel)
            self.views.append(GradView(param_name=v.param_name, offset_in_param=v.offset_in_param, tensor=tensor))

    def take_carried(self, role: InputRole) -> Tensor:
        return self._carried.pop(role)

    def hand_off(self, plan: Plan, grad: Tensor) -> None:
        if self.handed is not None or plan.hand_off is None:
            raise SimulationError(f"rank {self._rank}: a hand-off the plan does not declare once")
        self.handed = (plan.hand_off.buffer, grad, plan.hand_off.destination)

    def host_grad_buffer(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype)


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
    gradient (``layout.total_numel`` elements of the compute dtype); ``pending_unsharded``,
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
    own = [(g, e) for g, e in world.failures if not isinstance(e, _Aborted)]
    if own or world.failures:
        g, error = (own or world.failures)[0]
        if isinstance(error, RuntimeError) and not isinstance(error, SimulationError):
            raise SimulationError(f"rank {g}: {error}") from error
        raise error
    return WorldResult(request=request, geometry=geometry, ranks=tuple(r for r in ranks if r is not None))


def _inputs(rank: int, plan: Plan, inputs: Mapping[InputRole, Sequence[Tensor]]) -> dict[InputRole, Tensor]:
    """Rank ``rank``'s copy of each input ``plan`` takes, checked against its declared buffer."""
    out: dict[InputRole, Tensor] = {}
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
        out[op.role] = given.detach().to("cpu").reshape(-1).clone()
    unused = sorted(role.value for role in set(inputs) - set(out))
    if unused:
        raise SimulationError(f"inputs supplied but never taken by the plan: {', '.join(unused)}")
    return out


def _run_rank(
    world: InProcessWorld,
    rank: int,
    plan: Plan,
    inputs: dict[InputRole, Tensor],
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
