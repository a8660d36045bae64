"""A world of N ranks in one process: process groups whose members meet in-process, and a
``Runtime`` that runs each op as it comes.

``InProcessWorld`` is the meeting place; ``InProcessGroup`` is one rank's handle on a group of it,
a ``torch.distributed.ProcessGroup``, so ``torch.distributed``'s functions, this library's
(``runtime.collectives``) and a user's comm hook run on it unchanged: each collective blocks
until every member has issued it, and the last to arrive computes every member's result.
``InProcessRuntime`` runs plan ops on the calling thread in program order and issues its
collectives through ``runtime.collectives`` on such groups. ``runtime.simulate`` runs every
rank's plan of a world on them, under the interpreter that trains.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, assert_never

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # private, not stubbed
from torch.futures import Future

from fsdp_core import Group, ReduceOpSpec, Stream
from fsdp_shell.runtime.collectives import (
    Pending,
    Waitable,
    all_gather_flat,
    all_reduce_flat,
    reduce_scatter_flat,
    to_reduce_op,
)
from fsdp_shell.runtime.groups import ProcessGroups

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "InProcessGroup",
    "InProcessRuntime",
    "InProcessWorld",
    "Issued",
    "SimulationError",
    "WorldAborted",
    "WorldGeometry",
]

COLLECTIVE_TIMEOUT = 60.0
"""Seconds a rank waits for the rest of its group at a collective before the world fails."""


class SimulationError(RuntimeError):
    """A world that cannot run its plans: a buffer used before it exists or after it is freed; an
    input missing, unused or unlike its declared buffer; ranks whose collectives do not match or
    never meet."""


class WorldAborted(SimulationError):
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
                try:
                    if len({s for s, _, _ in ordered}) > 1:
                        raise SimulationError(
                            f"ranks {members} issue different collectives: {[s for s, _, _ in ordered]}"
                        )
                    land([s for _, s, _ in ordered], [d for _, _, d in ordered])
                except SimulationError as error:
                    meeting.error = error
                meeting.done = True
                self._cond.notify_all()
            while not meeting.done:
                if self.failures:
                    raise WorldAborted(f"rank {self.failures[0][0]} failed")
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
    kind = _kind(op)
    if kind == dist.ReduceOp.MAX:
        return torch.stack([t.to(acc) for t in tensors]).amax(0)
    if kind not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM):
        raise SimulationError(f"reduce op {kind} is not one the plans use")
    scale = float(op.factor) if kind == dist.ReduceOp.PREMUL_SUM else 1.0  # x 1.0 is exact
    total = torch.zeros(tensors[0].shape, dtype=acc)
    for t in tensors:
        total += t.to(acc) * scale
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

    frees_at_once = True

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

    def user_hook(self, stream: Stream, work: Callable[[], None], uses: tuple[Tensor, ...]) -> None:
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
