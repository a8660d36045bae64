"""A reference interpreter: one plan run for every rank of a simulated world, in one process.

``simulate`` builds the plan of every rank of a ``replicate_size x shard_size`` world and runs
all of them in lockstep on CPU tensors: op ``i`` on every rank, then op ``i + 1``. Collectives
are computed directly from the tensors of every member of the group: no ``torch.distributed``,
no processes, no streams. It exists to show numerically that a plan hands each rank exactly its
shard of the averaged gradient, and favours being obviously right over being fast.

Geometry is a 2-D ``DeviceMesh`` of shape ``(replicate, shard)``: global rank
``g = replicate_index * shard_size + shard_rank``. The shard group of ``g`` is the ranks with its
replicate index, ordered by shard rank; its replicate group is the ranks with its shard rank,
ordered by replicate index. ``NO_SHARD``'s shard group is the whole world.

Arithmetic: a reduction accumulates in float32 (float64 for float64 buffers) and rounds once to
the buffer's dtype. A real ring or tree reduction in float16/bfloat16 rounds after every step,
so low-precision results may differ from a real backend's in the last bits (ours being the more
accurate); float32 sums agree up to summation order.

Streams are ignored (ops run in plan order); waits and ``record_stream`` are bookkeeping. ``Free``
deletes the buffer, so a plan that reads a freed buffer fails here with ``SimulationError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import assert_never

import torch
from torch import Tensor

from fsdp_core.plan.ops import (
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
    RecordStream,
    ReduceScatter,
    WaitStream,
)
from fsdp_core.plan.planner import build_plan
from fsdp_core.plan.request import Plan, PlanRequest
from fsdp_core.spec.config import CommHook
from fsdp_core.spec.division import ReduceKind, ReduceOpSpec, fsdp1_predivide_factor

__all__ = [
    "GradView",
    "HookCall",
    "RankResult",
    "SimulationError",
    "WorldGeometry",
    "WorldResult",
    "simulate",
]

Planner = Callable[[PlanRequest], Plan]
"""Builds one rank's plan; ``simulate`` takes one so that tests can run altered plans."""


class SimulationError(RuntimeError):
    """A plan that cannot run: a buffer read before it exists or after it is freed, or produced
    twice; a tensor that disagrees with its declared buffer; operands that differ in numel or
    dtype where an op does not convert; ranks whose collectives do not match; a missing or
    unused input."""


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


@dataclass(frozen=True, slots=True, kw_only=True)
class GradView:
    """A ``GradViews`` entry: ``tensor`` (a 1-D view into the viewed buffer) holds the elements
    ``[offset_in_param, offset_in_param + tensor.numel())`` of the flattened parameter."""

    param_name: str
    offset_in_param: int
    tensor: Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class HookCall:
    """One call of a communication hook, as one rank saw it."""

    hook: CommHook
    group: Group
    members: tuple[int, ...]
    """Global ranks of the group it reduced over."""
    divides_by: int
    """The group size its state averages over."""
    wire_dtype: torch.dtype
    pre: float
    """What it divided by before reducing: ``fsdp1_predivide_factor(divides_by)``."""
    post: float
    """What it divided by after reducing: ``divides_by / pre``."""


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
    executed: tuple[Op, ...]
    """Every op run, in order (the whole plan when it ran to completion)."""
    unsharded_param_freed: bool
    """Whether the plan resharded (``FreeUnshardedParam``)."""
    live_buffers: tuple[str, ...]
    """Names of the buffers still allocated at the end (the handed-off one among them), oldest first."""


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


@dataclass(slots=True)
class _RankState:
    """One rank's run: its live buffers by name and what it has handed off, exposed or called."""

    rank: int
    plan: Plan
    tensors: dict[str, Tensor] = field(default_factory=dict)
    hand_off: tuple[Buffer, Tensor, Destination] | None = None
    views: list[GradView] = field(default_factory=list)
    hook_calls: list[HookCall] = field(default_factory=list)
    executed: list[Op] = field(default_factory=list)
    unsharded_param_freed: bool = False


@dataclass(slots=True)
class _Run:
    """All mutable state of one simulation."""

    geometry: WorldGeometry
    inputs: Mapping[InputRole, Sequence[Tensor]]
    ranks: list[_RankState]
    arrivals: dict[tuple[int, tuple[int, ...]], list[Op]] = field(default_factory=dict)
    roles_taken: set[InputRole] = field(default_factory=set)


def simulate(
    request: PlanRequest,
    grads: Sequence[Tensor],
    *,
    pending_unsharded: Sequence[Tensor] | None = None,
    sharded_grads: Sequence[Tensor] | None = None,
    partials: Sequence[Tensor] | None = None,
    planner: Planner = build_plan,
) -> WorldResult:
    """Run ``request``'s plan on every rank of its world and return what each rank handed off.

    Every sequence is indexed by global rank and must have one tensor per rank of the world
    (``request.sharding.data_parallel_size``). ``grads[g]`` is rank ``g``'s unsharded flat
    gradient (``layout.total_numel`` elements of the compute dtype); ``pending_unsharded``,
    ``sharded_grads`` and ``partials`` feed the plan's ``PENDING_UNSHARDED``, ``SHARDED_GRAD`` and
    ``PENDING_PARTIAL`` inputs and must be given exactly when the plan takes them. Each input
    tensor must match its declared buffer in numel and dtype; it is copied, never modified.
    ``request.sharding.rank`` is ignored: rank ``g`` plans with its own shard rank.

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
    lengths = {len(p.ops) for p in plans}
    if len(lengths) != 1:
        raise SimulationError(f"ranks' plans differ in length: {sorted(lengths)}")
    run = _Run(geometry=geometry, inputs=inputs, ranks=[_RankState(rank=g, plan=p) for g, p in enumerate(plans)])
    for index in range(lengths.pop()):
        for state in run.ranks:
            _execute(run, state, index, state.plan.ops[index])
    unused = sorted(role.value for role in set(inputs) - run.roles_taken)
    if unused:
        raise SimulationError(f"inputs supplied but never taken by the plan: {', '.join(unused)}")
    return WorldResult(request=request, geometry=geometry, ranks=tuple(_result(s) for s in run.ranks))


def _execute(run: _Run, state: _RankState, index: int, op: Op) -> None:
    """Run ``op``, the ``index``-th op of ``state``'s plan. A collective completes when the last
    member of its group reaches it, and then writes the result of every member."""
    state.executed.append(op)
    match op:
        case Input():
            _define(state, op.buffer, _input(run, state.rank, op))
        case WaitStream() | EndOfBackwardWait():
            pass
        case RecordStream():
            _tensor(state, op.buffer)
        case Free():
            _tensor(state, op.buffer)
            del state.tensors[op.buffer.name]
        case FreeUnshardedParam():
            if state.unsharded_param_freed:
                raise SimulationError(f"rank {state.rank}: the unsharded parameter is freed twice")
            state.unsharded_param_freed = True
        case Cast():
            _define(state, op.dst, _tensor(state, op.src).to(op.dst.dtype, copy=True))
        case Pad():
            src = _tensor(state, op.src)
            if op.dst.numel < op.src.numel:
                raise SimulationError(f"rank {state.rank}: pad shrinks {op.src} to {op.dst}")
            _define(state, op.dst, torch.cat([src, src.new_zeros(op.dst.numel - op.src.numel)]))
        case Divide():
            _tensor(state, op.buffer).div_(op.factor)
        case ReduceScatter():
            members = _arrive(run, state.rank, index, op, op.group)
            if members is not None:
                _reduce_scatter(run, members, op)
        case AllReduce():
            members = _arrive(run, state.rank, index, op, op.group)
            if members is not None:
                _all_reduce(run, members, op)
        case CommHookCall():
            members = _arrive(run, state.rank, index, op, op.group)
            if members is not None:
                _comm_hook(run, members, op)
        case Accumulate():
            _alike(state, op.src, op.dst)
            _tensor(state, op.dst).add_(_tensor(state, op.src))
        case Offload():
            _alike(state, op.src, op.dst)
            src = _tensor(state, op.src)
            if op.accumulate:
                _tensor(state, op.dst).add_(src.to("cpu"))
            else:
                _define(state, op.dst, src.to("cpu", copy=True))
        case GradViews():
            buffer = _tensor(state, op.buffer)
            for v in op.views:
                if v.offset_in_buffer < 0 or v.offset_in_buffer + v.numel > op.buffer.numel:
                    raise SimulationError(f"rank {state.rank}: view of {v.param_name} lies outside {op.buffer}")
                view = buffer.narrow(0, v.offset_in_buffer, v.numel)
                state.views.append(GradView(param_name=v.param_name, offset_in_param=v.offset_in_param, tensor=view))
        case HandOff():
            if state.hand_off is not None:
                raise SimulationError(f"rank {state.rank}: a second hand-off at op {index}")
            state.hand_off = (op.buffer, _tensor(state, op.buffer), op.destination)
        case _:
            assert_never(op)


def _input(run: _Run, rank: int, op: Input) -> Tensor:
    tensors = run.inputs.get(op.role)
    if tensors is None:
        raise SimulationError(f"the plan takes a {op.role.value} input ({op.buffer}) that was not supplied")
    run.roles_taken.add(op.role)
    given = tensors[rank]
    if given.numel() != op.buffer.numel or given.dtype != op.buffer.dtype:
        raise SimulationError(
            f"rank {rank}: {op.role.value} input has {given.numel()} elements of {given.dtype}, "
            f"the plan declares {op.buffer}"
        )
    return given.detach().to("cpu").reshape(-1).clone()


def _tensor(state: _RankState, buffer: Buffer) -> Tensor:
    """The live tensor behind ``buffer``; it must match the declaration."""
    t = state.tensors.get(buffer.name)
    if t is None:
        raise SimulationError(f"rank {state.rank}: {buffer.name} is used but does not exist (never produced, or freed)")
    if t.dtype != buffer.dtype or t.numel() != buffer.numel:
        raise SimulationError(f"rank {state.rank}: {buffer} is declared, but holds {t.numel()} elements of {t.dtype}")
    return t


def _define(state: _RankState, buffer: Buffer, tensor: Tensor) -> None:
    """Allocate ``buffer`` holding ``tensor``; it must not be alive already."""
    if buffer.name in state.tensors:
        raise SimulationError(f"rank {state.rank}: {buffer.name} is produced again while alive")
    state.tensors[buffer.name] = tensor
    _tensor(state, buffer)


def _alike(state: _RankState, src: Buffer, dst: Buffer) -> None:
    """``src`` and ``dst`` must agree in numel and dtype (no silent broadcast or cast)."""
    if src.numel != dst.numel or src.dtype != dst.dtype:
        raise SimulationError(f"rank {state.rank}: {src} and {dst} differ in numel or dtype")


def _arrive(run: _Run, rank: int, index: int, op: Op, group: Group) -> tuple[int, ...] | None:
    """Record that ``rank`` reached collective ``op`` at ``index``; return the group's members
    once all have, checking that they issued the same collective."""
    members = run.geometry.members(rank, group)
    arrived = run.arrivals.setdefault((index, members), [])
    arrived.append(op)
    if len(arrived) < len(members):
        return None
    if any(other != op for other in arrived):
        raise SimulationError(f"op {index}: ranks {members} issue different collectives: {arrived}")
    return members


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduce(tensors: Sequence[Tensor], reduce_op: ReduceOpSpec, dtype: torch.dtype) -> Tensor:
    """``reduce_op`` over ``tensors``, accumulated in float32 (float64 for float64) and rounded
    once to ``dtype``."""
    acc = _accumulation_dtype(dtype)
    total = torch.zeros(tensors[0].shape, dtype=acc)
    match reduce_op.kind:
        case ReduceKind.SUM:
            for t in tensors:
                total += t.to(acc)
        case ReduceKind.AVG:
            for t in tensors:
                total += t.to(acc)
            total /= len(tensors)
        case ReduceKind.PREMUL_SUM:
            for t in tensors:
                total += t.to(acc) * reduce_op.premul
        case _:
            assert_never(reduce_op.kind)
    return total.to(dtype)


def _chunks(total: Tensor, members: tuple[int, ...], src: Buffer, dst: Buffer) -> tuple[Tensor, ...]:
    """Split ``total`` (reduced from ``src``) into one ``dst`` per member, in group order."""
    if src.numel != dst.numel * len(members) or src.dtype != dst.dtype:
        raise SimulationError(f"cannot reduce-scatter {src} into {dst} over {len(members)} ranks")
    return tuple(c.clone() for c in total.chunk(len(members)))


def _reduce_scatter(run: _Run, members: tuple[int, ...], op: ReduceScatter) -> None:
    sent = [_tensor(run.ranks[m], op.src) for m in members]
    total = _reduce(sent, op.reduce_op, op.src.dtype)
    for m, chunk in zip(members, _chunks(total, members, op.src, op.dst)):
        _define(run.ranks[m], op.dst, chunk)


def _all_reduce(run: _Run, members: tuple[int, ...], op: AllReduce) -> None:
    buffers = [_tensor(run.ranks[m], op.buffer) for m in members]
    total = _reduce(buffers, op.reduce_op, op.buffer.dtype)
    for b in buffers:
        b.copy_(total)


def _comm_hook(run: _Run, members: tuple[int, ...], op: CommHookCall) -> None:
    """The built-in hooks of ``torch.distributed.algorithms._comm_hooks.default_hooks``: cast to
    the wire dtype, divide by ``pre``, sum over the group, divide by ``post``, cast back.
    ``ALLREDUCE`` all-reduces ``src`` in place and keeps this rank's chunk in ``dst`` (when ``dst``
    differs); the others reduce-scatter into ``dst``, or all-reduce in place when ``dst`` is ``src``.
    ``USER`` is assumed to honour that same contract. ``dst`` has ``src``'s dtype."""
    in_place = op.dst.name == op.src.name
    match op.hook:
        case CommHook.NONE:
            raise SimulationError("a comm hook call without a comm hook")
        case CommHook.REDUCE_SCATTER if in_place:
            raise SimulationError("the reduce_scatter hook needs an output distinct from its input")
        case CommHook.ALLREDUCE:
            all_reduces = True
        case CommHook.REDUCE_SCATTER | CommHook.FP16_COMPRESS | CommHook.BF16_COMPRESS | CommHook.USER:
            all_reduces = in_place
        case _:
            assert_never(op.hook)
    pre = float(fsdp1_predivide_factor(op.divides_by))
    post = op.divides_by / pre
    sent = [_tensor(run.ranks[m], op.src).to(op.wire_dtype, copy=True).div_(pre) for m in members]
    total = _reduce(sent, ReduceOpSpec(), op.wire_dtype).div_(post)
    chunks = () if in_place else _chunks(total, members, op.src, op.dst)
    for position, m in enumerate(members):
        state = run.ranks[m]
        if all_reduces:
            _tensor(state, op.src).copy_(total)
        if not in_place:
            _define(state, op.dst, chunks[position].to(op.src.dtype))
        state.hook_calls.append(
            HookCall(
                hook=op.hook,
                group=op.group,
                members=members,
                divides_by=op.divides_by,
                wire_dtype=op.wire_dtype,
                pre=pre,
                post=post,
            )
        )


def _result(state: _RankState) -> RankResult:
    buffer, grad, destination = state.hand_off if state.hand_off is not None else (None, None, None)
    return RankResult(
        rank=state.rank,
        plan=state.plan,
        grad=grad,
        buffer=buffer,
        destination=destination,
        views=tuple(state.views),
        hook_calls=tuple(state.hook_calls),
        executed=tuple(state.executed),
        unsharded_param_freed=state.unsharded_param_freed,
        live_buffers=tuple(state.tensors),
    )
