"""What one post-backward plan holds, op by op: exact bytes from the plan's own buffers.

A plan names every buffer it allocates, frees and hands off, so the bytes it holds after each op
follow from the ops alone, given how the runtime returns a freed buffer (``Executor``):

- ``Executor.STREAMS`` (an accelerator): a ``Free`` returns the buffer at that op, as the caching
  allocator's allocated bytes count it (a block kept by ``record_stream`` for another stream
  is not handed out again until that stream is done, but it is no longer counted as allocated
  by the plan's owner).
- ``Executor.CPU_LANE`` (``fsdp_shell.runtime.cpu``): where each op runs and when a freed buffer
  returns are ``fsdp_core.execution.lane.LaneOrder``'s decisions, the very ones the runtime
  carries out; this walk folds over them. On the CPU the host is the device, so an ``Offload``
  copies nothing: its host buffer is the device buffer itself. A reduce-scatter in the form
  ``fsdp_core.execution.lane.scatter_form`` calls ``ALL_TO_ALL`` holds a receive buffer the
  size of its input while it runs.

Every figure is relative to the moment before the plan starts, when its inputs (the new
gradient from autograd, carried gradients) and the unsharded parameter are live already: the
plan decides when they go, so what it frees of them counts negative.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import assert_never

from fsdp_core.execution import LaneOrder, Place, scatter_form
from fsdp_core.memory.allocator import EXACT, Allocator
from fsdp_core.plan.ops import (
    Accumulate,
    AllReduce,
    AllReduceHookCall,
    Buffer,
    Cast,
    CommHookCall,
    CopyIn,
    Device,
    Divide,
    EndOfBackwardWait,
    Free,
    FreeUnshardedParam,
    GradViews,
    Group,
    HandOff,
    Input,
    Offload,
    Op,
    Pad,
    RecordStream,
    ReduceScatter,
    Stream,
    WaitStream,
)
from fsdp_core.plan.request import Plan, PlanRequest, buffers_of

__all__ = [
    "BackwardMemory",
    "Executor",
    "HookFootprint",
    "Place",
    "PlanMemory",
    "backward_footprints",
    "backward_memory",
    "plan_memory",
    "unsharded_param_bytes",
]


class Executor(enum.Enum):
    """How a runtime runs a plan's ops and returns the buffers it frees (module docstring)."""

    STREAMS = "streams"
    CPU_LANE = "cpu_lane"


@dataclass(frozen=True, slots=True)
class PlanMemory:
    """Device bytes allocated minus bytes returned since the plan started (module docstring).

    ``after``: after each op (``plan.ops`` order); buffers freed but not yet returned still
    count. ``peak``: the highest at any moment (0 at the start), a collective's scratch
    included, reached first during op ``peak_op`` (-1: at the start). ``end``: after the last
    op, and ``after_hook`` after the hook ops (``Plan.hook_ops``; the rest run at the end of
    backward), when ``returned_later`` of it is freed but returned only at the host's next wait
    for the lane; ``hook_peak``: the peak during the hook ops. ``inputs``: bytes of what the
    plan found (its ``Input`` ops); ``unsharded``: bytes of the unsharded parameter it frees;
    ``handed_off``: bytes it hands to the optimizer (they live on as the sharded gradient).
    ``places``: where each op ran (the iteration simulator times the CPU runtime by it)."""

    places: tuple[Place, ...]

    after: tuple[int, ...]
    peak: int
    peak_op: int
    end: int
    after_hook: int
    hook_peak: int
    returned_later: int
    inputs: int
    unsharded: int
    handed_off: int


def unsharded_param_bytes(request: PlanRequest, allocator: Allocator = EXACT) -> int:
    """Bytes of the unit's unsharded flat parameter that a reshard frees: the padded flat
    parameter in the compute dtype, where it is gathered into memory of its own (sharded, a
    compute dtype of its own, or offloaded); 0 where the unsharded parameter is the local one."""
    compute = request.compute_dtype
    own = request.sharding.strategy.is_sharded or compute != request.layout.dtype or request.offload.offload_params
    return allocator.size(request.padded_numel * compute.itemsize) if own else 0


@dataclass(frozen=True, slots=True, eq=False)
class _Held:
    """Memory a plan freed that the lane still uses: returned when the host has waited for it."""

    plan: object
    """The walk of the plan that freed it (its identity)."""
    bytes: int


def plan_memory(
    plan: Plan,
    executor: Executor,
    *,
    lane_issues_shard: bool = False,
    lane: LaneOrder[_Held] | None = None,
    allocator: Allocator = EXACT,
    unsharded: int | None = None,
) -> PlanMemory:
    """The plan's bytes op by op under ``executor``, each buffer as ``allocator`` sizes it.
    ``lane_issues_shard``: the CPU lane issues shard-group collectives too when behind.
    ``lane``: on the CPU, the lane as earlier plans of the backward left it (``backward_memory``;
    default: an empty one); the hook ops go on with it, what they return of earlier plans'
    memory counting negative. The ops after them run at the end of backward and are walked on
    a copy, leaving ``lane`` as the next plan finds it. ``unsharded``: the bytes its
    ``FreeUnshardedParam`` frees (None: ``unsharded_param_bytes``, a flat parameter's; a
    per-parameter unit's are its gathered parameters', which its request's reduce layout does not
    know: ``fsdp_core.memory.unshard_memory.per_param_gather_bytes``)."""
    if lane is None:
        lane = LaneOrder(lane_issues_shard=lane_issues_shard)
    if unsharded is None:
        unsharded = unsharded_param_bytes(plan.request, allocator)
    walk = _Walk(plan, executor, lane, unsharded, allocator)
    hook_ops = len(plan.hook_ops)
    after_hook, hook_peak, returned_later = 0, 0, 0
    for index, op in enumerate(plan.ops):
        if index == hook_ops:
            after_hook, hook_peak, returned_later = walk.live, walk.peak, walk.own_pending
            walk.lane = walk.lane.fork()
        walk.step(index, op)
    if hook_ops == len(plan.ops):
        after_hook, hook_peak, returned_later = walk.live, walk.peak, walk.own_pending
    return PlanMemory(
        places=tuple(walk.places),
        after=tuple(walk.after),
        peak=walk.peak,
        peak_op=walk.peak_op,
        end=walk.live,
        after_hook=after_hook,
        hook_peak=hook_peak,
        returned_later=returned_later,
        inputs=walk.inputs,
        unsharded=walk.unsharded_freed,
        handed_off=walk.handed_off,
    )


class _Walk:
    """The plan's buffers as the runtime holds them, one op at a time."""

    def __init__(
        self, plan: Plan, executor: Executor, lane: LaneOrder[_Held], unsharded: int, allocator: Allocator
    ) -> None:
        self.ops = plan.ops
        self.request = plan.request
        self.src_dies = plan.src_dies
        self.allocator = allocator
        self.unsharded = unsharded
        self.unsharded_freed = 0
        self.executor = executor
        self.cpu = executor is Executor.CPU_LANE
        self.lane = lane
        self.serial = object()
        """Tells this plan's buffers apart in a lane shared by several plans: their names repeat."""
        self.held: dict[str, Buffer] = {}
        """By name, the buffers bound now, each with its own memory (aliases are in ``alias``)."""
        self.alias: dict[str, str] = {}
        """A buffer name bound to another's memory (the CPU's offload host buffer)."""
        self.live = 0
        self.peak = 0
        self.peak_op = -1
        self.inputs = 0
        self.handed_off = 0
        self.after: list[int] = []
        self.places: list[Place] = []
        self.place = Place.STREAM if executor is Executor.STREAMS else Place.HOST
        """Where the op being walked runs."""

    # -- accounting ----------------------------------------------------------------------------

    def _bytes(self, b: Buffer) -> int:
        """``b``'s bytes on the compute device: host buffers count where the host is the device."""
        if b.device is Device.HOST and not self.cpu:
            return 0
        return self.allocator.size(b.nbytes)

    @property
    def own_pending(self) -> int:
        """Bytes this plan freed that the lane still holds."""
        return sum(h.bytes for h in self.lane.pending() if h.plan == self.serial)

    def _note(self, index: int, extra: int = 0) -> None:
        if self.live + extra > self.peak:
            self.peak, self.peak_op = self.live + extra, index

    def _bind(self, b: Buffer) -> None:
        if b.name not in self.held:
            self.held[b.name] = b
            self.live += self._bytes(b)

    def _key(self, name: str) -> Hashable:
        """The identity of ``name``'s memory in the lane."""
        return (self.serial, self.alias.get(name, name))

    def _uses(self, op: Op) -> tuple[Hashable, ...]:
        return tuple(self._key(b.name) for b in buffers_of(op))

    def _free(self, b: Buffer) -> None:
        name = b.name
        if name in self.alias:
            del self.alias[name]
            return
        heirs = [k for k, v in self.alias.items() if v == name]
        if heirs:
            heir = heirs[0]
            self.held[heir] = self.held.pop(name)
            self.alias = {k: heir for k, v in self.alias.items() if v == name and k != heir} | {
                k: v for k, v in self.alias.items() if v != name
            }
            return
        held = self.held.pop(name, None)
        if held is None:
            return
        if not self.cpu or self.lane.free(self._key(name), _Held(self.serial, self._bytes(held))):
            self.live -= self._bytes(held)

    def _returned(self, items: list[_Held]) -> None:
        self.live -= sum(h.bytes for h in items)

    def _drain(self) -> None:
        self.place = Place.HOST_AFTER_DRAIN
        self._returned(self.lane.drain())

    # -- placement on the CPU lane (fsdp_core.execution.lane.LaneOrder) ------------------------

    def _compute(self, op: Op, stream: Stream) -> None:
        if self.cpu:
            self.place = self.lane.compute(stream, self._uses(op))

    def _collective(self, op: Op, stream: Stream, group: Group, extra: tuple[Hashable, ...] = ()) -> Place:
        """Place a collective using ``op``'s buffers and ``extra`` ones (a receive buffer)."""
        if not self.cpu:
            return Place.STREAM
        place = self.lane.collective(stream, group, self._uses(op) + extra)
        if place is Place.HOST_AFTER_DRAIN:
            self._drain()
        self.place = place
        return place

    def _on_host(self, op: Op) -> None:
        if self.cpu and self.lane.on_host(self._uses(op)) is Place.HOST_AFTER_DRAIN:
            self._drain()

    # -- the ops -------------------------------------------------------------------------------

    def step(self, index: int, op: Op) -> None:
        self.place = Place.HOST if self.cpu else Place.STREAM
        match op:
            case Input():
                self.held.setdefault(op.buffer.name, op.buffer)
                self.inputs += self._bytes(op.buffer)
            case FreeUnshardedParam():
                self.live -= self.unsharded
                self.unsharded_freed += self.unsharded
            case WaitStream() | RecordStream():
                pass
            case EndOfBackwardWait():
                if self.cpu:
                    self._drain()
            case Free():
                self._free(op.buffer)
            case Cast() | Pad() | CopyIn():
                self._bind(op.dst)
                self._compute(op, op.stream)
            case Divide() | Accumulate():
                self._compute(op, op.stream)
            case ReduceScatter():
                self._bind(op.dst)
                scratch = self._scratch(index, op)
                receive = Buffer(name=f"{op.dst.name}.receive", numel=op.src.numel, dtype=op.src.dtype)
                extra = (self._key(receive.name),) if scratch else ()
                if self._collective(op, op.stream, op.group, extra) is Place.LANE and scratch:
                    self.live += scratch
                    self.lane.free(self._key(receive.name), _Held(self.serial, scratch))
                else:
                    self._note(index, scratch)
            case AllReduce():
                self._collective(op, op.stream, op.group)
            case CommHookCall():
                self._bind(op.dst)
                self._collective(op, op.stream, op.group)
            case Offload():
                if not op.accumulate:
                    if self.cpu:
                        self.alias[op.dst.name] = self.alias.get(op.src.name, op.src.name)
                    else:
                        self._bind(op.dst)
                self._compute(op, op.stream)
            case GradViews() | AllReduceHookCall():  # on the CPU the all-reduce hook runs on the host
                self._on_host(op)
            case HandOff():
                self._on_host(op)
                memory = self.held.get(self.alias.get(op.buffer.name, op.buffer.name))
                if memory is not None:
                    self.handed_off += self._bytes(memory)
            case _:
                assert_never(op)
        self._note(index)
        self.after.append(self.live)
        self.places.append(self.place)

    def _scratch(self, index: int, op: ReduceScatter) -> int:
        """The receive buffer of the reduce-scatter's form on gloo (module docstring)."""
        if not self.cpu:
            return 0
        form = scatter_form(
            op.reduce_op.kind,
            op.src.nbytes,
            gloo=True,
            src_dies=index in self.src_dies,
            ranks=self.request.group_size(op.group),
        )
        return op.src.nbytes if form.receive_buffer else 0


@dataclass(frozen=True, slots=True)
class HookFootprint:
    """One plan's post-backward hook within a backward: what it holds (``memory``, from its own
    start), ``returned_at_start``: bytes earlier plans freed that come back as it begins (the
    host's wait for plans more than ``PLANS_IN_FLIGHT`` back, through lane ticket
    ``waited_through``; 0: no wait), and from just before that, the hook's ``peak`` and its
    ``net`` bytes."""

    memory: PlanMemory
    returned_at_start: int
    peak: int
    net: int
    waited_through: int = 0


@dataclass(frozen=True, slots=True)
class BackwardMemory:
    """The post-backward plans of one backward: each hook's footprint, in the order they ran,
    and ``returned_at_end``: the bytes they freed that come back only at the end of backward
    (the host's wait for the whole lane; 0 on a device's streams)."""

    hooks: tuple[HookFootprint, ...]
    returned_at_end: int


def backward_memory(
    plans: Sequence[Plan],
    executor: Executor,
    *,
    lane_issues_shard: bool = False,
    allocator: Allocator = EXACT,
    unsharded: Sequence[int | None] | None = None,
) -> BackwardMemory:
    """The post-backward hooks of one backward, in the order they run, over one lane
    (``LaneOrder``) as the runtime keeps it: at a plan's start (``begin_plan``) the host waits
    for the lane work of plans more than ``PLANS_IN_FLIGHT`` back and returns what they freed.
    On a device's streams nothing carries over. The ops deferred to the end of backward
    allocate and free nothing; there the host waits for the lane, returning what is left.
    ``unsharded``: per plan, ``plan_memory``'s."""
    out: list[HookFootprint] = []
    lane: LaneOrder[_Held] = LaneOrder(lane_issues_shard=lane_issues_shard)
    for index, plan in enumerate(plans):
        returned, ticket = 0, 0
        if executor is Executor.CPU_LANE:
            ticket = lane.begin_plan()
            returned = sum(h.bytes for h in lane.waited_through(ticket))
        m = plan_memory(
            plan, executor, lane=lane, allocator=allocator, unsharded=None if unsharded is None else unsharded[index]
        )
        out.append(HookFootprint(m, returned, max(0, m.hook_peak - returned), m.after_hook - returned, ticket))
    return BackwardMemory(tuple(out), sum(h.bytes for h in lane.pending()))


def backward_footprints(
    plans: Sequence[Plan], executor: Executor, *, lane_issues_shard: bool = False, allocator: Allocator = EXACT
) -> tuple[HookFootprint, ...]:
    """``backward_memory``'s hooks."""
    return backward_memory(plans, executor, lane_issues_shard=lane_issues_shard, allocator=allocator).hooks
