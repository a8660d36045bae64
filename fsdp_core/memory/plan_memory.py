"""What one post-backward plan holds, op by op: exact bytes from the plan's own buffers.

A plan names every buffer it allocates, frees and hands off, so the bytes it holds after each op
follow from the ops alone, given how the runtime returns a freed buffer (``Executor``):

- ``Executor.STREAMS`` (an accelerator): a ``Free`` returns the buffer at that op, as the caching
  allocator's allocated bytes count it (a block kept by ``record_stream`` for another stream
  is not handed out again until that stream is done, but it is no longer counted as allocated
  by the plan's owner).
- ``Executor.CPU_LANE`` (``fsdp_shell.runtime.cpu``): work that must wait for a replicate-group
  collective runs on the lane; a ``Free`` of a buffer that lane work uses is returned only when
  the host next waits for the lane: at the start of the plan ``PLANS_IN_FLIGHT`` plans later, or
  at the end of backward. On the CPU the host is the device, so an ``Offload`` copies nothing:
  its host buffer is the device buffer itself. A summing reduce-scatter on gloo holds a receive
  buffer the size of its input while it runs, when the input is at most
  ``GLOO_ALL_TO_ALL_MAX_BYTES`` or must survive it.

Every figure is relative to the moment before the plan starts, when its inputs (the new
gradient from autograd, carried gradients) and the unsharded parameter are live already: the
plan decides when they go, so what it frees of them counts negative.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from fsdp_core.memory.allocator import EXACT, Allocator
from fsdp_core.plan.ops import (
    Accumulate,
    AllReduce,
    Buffer,
    Cast,
    CommHookCall,
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
from fsdp_core.plan.planner import PLANS_IN_FLIGHT
from fsdp_core.plan.request import Plan, PlanRequest, buffers_of
from fsdp_core.spec.division import ReduceKind

__all__ = [
    "GLOO_ALL_TO_ALL_MAX_BYTES",
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

GLOO_ALL_TO_ALL_MAX_BYTES = 4 << 20
"""Summing reduce-scatters on gloo with inputs up to this size go by all-to-all into a receive
buffer the size of the input (``fsdp_shell.runtime.cpu.gloo_reduce_scatter``); larger ones
reduce their input in place when it dies with them."""


class Executor(enum.Enum):
    """How a runtime runs a plan's ops and returns the buffers it frees (module docstring)."""

    STREAMS = "streams"
    CPU_LANE = "cpu_lane"


class Place(enum.Enum):
    """Where the runtime runs one op of a plan."""

    STREAM = "stream"
    """On its stream (a device's streams)."""
    HOST = "host"
    """On the CPU's host thread, which waits for a collective there."""
    LANE = "lane"
    """On the CPU's lane thread, in order behind earlier lane work."""
    HOST_AFTER_DRAIN = "host_after_drain"
    """On the host thread, once it has waited for all the lane's work."""


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
    ``lane_keys``: the streams and groups with lane work at the end of the hook ops (behind for
    the next plan); ``drained``: whether the hook ops waited for the whole lane (returning what
    earlier plans had freed). ``places``: where each op ran (the iteration simulator times the
    CPU runtime by it)."""

    lane_keys: frozenset[Stream | Group]
    drained: bool
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
    return allocator.size(request.sharding.padded_numel(request.layout) * compute.itemsize) if own else 0


def plan_memory(
    plan: Plan,
    executor: Executor,
    *,
    lane_issues_shard: bool = False,
    behind: frozenset[Stream | Group] = frozenset(),
    earlier_deferred: int = 0,
    allocator: Allocator = EXACT,
) -> PlanMemory:
    """The plan's bytes op by op under ``executor``, each buffer as ``allocator`` sizes it.
    ``lane_issues_shard``: the CPU lane issues shard-group collectives too when behind (the
    all-gathers have a group of their own).
    ``behind``: the streams and groups with lane work of earlier plans the host has not waited
    for when this plan starts; ``earlier_deferred``: bytes earlier plans freed that are still to
    be returned (a wait for the whole lane inside this plan returns them, counted here)."""
    walk = _Walk(plan.ops, executor, lane_issues_shard, unsharded_param_bytes(plan.request, allocator), allocator)
    walk.lane_streams.update(behind)
    walk.earlier_deferred = earlier_deferred
    hook_ops = len(plan.hook_ops)
    after_hook, hook_peak, returned_later = 0, 0, 0
    for index, op in enumerate(plan.ops):
        if index == hook_ops:
            after_hook, hook_peak, returned_later = walk.live, walk.peak, walk.deferred_bytes
            walk.end_hook()
        walk.step(index, op)
    if hook_ops == len(plan.ops):
        after_hook, hook_peak, returned_later = walk.live, walk.peak, walk.deferred_bytes
        walk.end_hook()
    return PlanMemory(
        lane_keys=frozenset(walk.hook_lane_keys),
        drained=walk.drained,
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
        self, ops: tuple[Op, ...], executor: Executor, lane_issues_shard: bool, unsharded: int, allocator: Allocator
    ) -> None:
        self.ops = ops
        self.allocator = allocator
        self.unsharded = unsharded
        self.unsharded_freed = 0
        self.earlier_deferred = 0
        self.drained = False
        self.hook_lane_keys: set[Stream | Group] = set()
        self.in_hook = True
        self.executor = executor
        self.lane_issues = {Group.REPLICATE, Group.SHARD} if lane_issues_shard else {Group.REPLICATE}
        self.held: dict[str, Buffer] = {}
        """By name, the buffers bound now, each with its own memory (aliases are in ``alias``)."""
        self.alias: dict[str, str] = {}
        """A buffer name bound to another's memory (the CPU's offload host buffer)."""
        self.deferred: list[Buffer] = []
        self.lane_streams: set[Stream | Group] = set()
        self.lane_buffers: set[str] = set()
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
        if b.device is Device.HOST and self.executor is not Executor.CPU_LANE:
            return 0
        return self.allocator.size(b.nbytes)

    @property
    def deferred_bytes(self) -> int:
        return sum(self._bytes(b) for b in self.deferred)

    def _note(self, index: int, extra: int = 0) -> None:
        if self.live + extra > self.peak:
            self.peak, self.peak_op = self.live + extra, index

    def _bind(self, b: Buffer) -> None:
        if b.name not in self.held:
            self.held[b.name] = b
            self.live += self._bytes(b)

    def _memory_of(self, name: str) -> str:
        return self.alias.get(name, name)

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
        if self.executor is Executor.CPU_LANE and name in self.lane_buffers:
            self.deferred.append(held)
            return
        self.live -= self._bytes(held)

    def end_hook(self) -> None:
        """The hook ops are done: what the lane holds now is the next plan's ``behind``."""
        self.hook_lane_keys = set(self.lane_streams)
        self.in_hook = False

    def _drain(self) -> None:
        if self.in_hook:
            self.drained = True
        self.live -= self.earlier_deferred
        self.earlier_deferred = 0
        for b in self.deferred:
            self.live -= self._bytes(b)
        self.deferred = []
        self.lane_streams.clear()
        self.lane_buffers.clear()

    # -- placement on the CPU lane (fsdp_shell.runtime.cpu.CpuRuntime) -------------------------

    def _behind(self, keys: tuple[Stream | Group, ...], uses: tuple[Buffer, ...]) -> bool:
        return any(k in self.lane_streams for k in keys) or any(
            self._memory_of(b.name) in self.lane_buffers for b in uses
        )

    def _to_lane(self, keys: tuple[Stream | Group, ...], uses: tuple[Buffer, ...]) -> None:
        self.place = Place.LANE
        self.lane_streams.update(keys)
        self.lane_buffers.update(self._memory_of(b.name) for b in uses)

    def _compute(self, stream: Stream, uses: tuple[Buffer, ...]) -> None:
        if self.executor is Executor.CPU_LANE and self._behind((stream,), uses):
            self._to_lane((stream,), uses)

    def _collective(self, stream: Stream, group: Group, uses: tuple[Buffer, ...]) -> bool:
        """Place a collective; whether it went to the lane."""
        if self.executor is not Executor.CPU_LANE:
            return False
        keys = (stream, group)
        behind = self._behind(keys, uses)
        if group is Group.REPLICATE or (behind and group in self.lane_issues):
            self._to_lane(keys, uses)
            return True
        if behind:
            self._drain()
            self.place = Place.HOST_AFTER_DRAIN
        return False

    def _on_host(self, uses: tuple[Buffer, ...]) -> None:
        if self.executor is Executor.CPU_LANE and self._behind((), uses):
            self._drain()
            self.place = Place.HOST_AFTER_DRAIN

    # -- the ops -------------------------------------------------------------------------------

    def step(self, index: int, op: Op) -> None:
        self.place = Place.STREAM if self.executor is Executor.STREAMS else Place.HOST
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
                if self.executor is Executor.CPU_LANE:
                    self._drain()
                    self.place = Place.HOST_AFTER_DRAIN
            case Free():
                self._free(op.buffer)
            case Cast() | Pad():
                self._bind(op.dst)
                self._compute(op.stream, buffers_of(op))
            case Divide():
                self._compute(op.stream, buffers_of(op))
            case Accumulate():
                self._compute(op.stream, buffers_of(op))
            case ReduceScatter():
                self._bind(op.dst)
                scratch = self._scratch(index, op)
                if self._collective(op.stream, op.group, buffers_of(op)) and scratch:
                    self.live += scratch
                    self.deferred.append(Buffer(name=f"{op.dst.name}.receive", numel=op.src.numel, dtype=op.src.dtype))
                else:
                    self._note(index, scratch)
            case AllReduce():
                self._collective(op.stream, op.group, buffers_of(op))
            case CommHookCall():
                self._bind(op.dst)
                self._collective(op.stream, op.group, buffers_of(op))
            case Offload():
                if not op.accumulate:
                    if self.executor is Executor.CPU_LANE:
                        self.alias[op.dst.name] = self._memory_of(op.src.name)
                    else:
                        self._bind(op.dst)
                self._compute(op.stream, buffers_of(op))
            case GradViews():
                self._on_host(buffers_of(op))
            case HandOff():
                self._on_host(buffers_of(op))
                memory = self.held.get(self._memory_of(op.buffer.name))
                if memory is not None:
                    self.handed_off += self._bytes(memory)
            case _:
                assert_never(op)
        self._note(index)
        self.after.append(self.live)
        self.places.append(self.place)

    def _scratch(self, index: int, op: ReduceScatter) -> int:
        """The receive buffer of a summing reduce-scatter on gloo (module docstring)."""
        if self.executor is not Executor.CPU_LANE or op.reduce_op.kind is not ReduceKind.SUM:
            return 0
        if op.src.nbytes > GLOO_ALL_TO_ALL_MAX_BYTES and self._dies_after(index, op.src):
            return 0
        return op.src.nbytes

    def _dies_after(self, index: int, src: Buffer) -> bool:
        """Whether no op after ``index`` uses ``src`` before the plan frees it (the interpreter's
        ``src_dies``)."""
        for op in self.ops[index + 1 :]:
            if isinstance(op, Free) and op.buffer == src:
                return True
            if not isinstance(op, RecordStream) and src in buffers_of(op):
                return False
        return False


@dataclass(frozen=True, slots=True)
class HookFootprint:
    """One plan's post-backward hook within a backward: what it holds (``memory``, from its own
    start), ``returned_at_start``: bytes earlier plans freed that come back as it begins (the
    host's wait for plans more than ``PLANS_IN_FLIGHT`` back), and from just before that, the
    hook's ``peak`` and its ``net`` bytes."""

    memory: PlanMemory
    returned_at_start: int
    peak: int
    net: int


@dataclass(frozen=True, slots=True)
class BackwardMemory:
    """The post-backward plans of one backward: each hook's footprint, in the order they ran,
    and ``returned_at_end``: the bytes they freed that come back only at the end of backward
    (the host's wait for the whole lane; 0 on a device's streams)."""

    hooks: tuple[HookFootprint, ...]
    returned_at_end: int


def backward_memory(
    plans: Sequence[Plan], executor: Executor, *, lane_issues_shard: bool = False, allocator: Allocator = EXACT
) -> BackwardMemory:
    """The post-backward hooks of one backward, in the order they run: each plan walked with
    the lane as the earlier ones leave it (``Runtime.begin_plan``: at a plan's start the host
    waits for the lane work of plans more than ``PLANS_IN_FLIGHT`` back and returns what they
    freed). On a device's streams nothing carries over. The ops deferred to the end of backward
    allocate and free nothing; there the host waits for the lane, returning what is left."""
    out: list[HookFootprint] = []
    pending: list[int] = []
    """Per earlier plan (by index), the bytes it freed that are not returned yet."""
    for j, plan in enumerate(plans):
        returned = 0
        behind: frozenset[Stream | Group] = frozenset()
        if executor is Executor.CPU_LANE:
            for k in range(j - PLANS_IN_FLIGHT):
                returned += pending[k]
                pending[k] = 0
            for earlier in out[max(0, j - PLANS_IN_FLIGHT) :]:
                behind |= earlier.memory.lane_keys
        m = plan_memory(
            plan,
            executor,
            lane_issues_shard=lane_issues_shard,
            behind=behind,
            earlier_deferred=sum(pending),
            allocator=allocator,
        )
        if m.drained:
            pending = [0] * len(pending)
        pending.append(m.returned_later)
        out.append(HookFootprint(m, returned, max(0, m.hook_peak - returned), m.after_hook - returned))
    return BackwardMemory(tuple(out), sum(pending))


def backward_footprints(
    plans: Sequence[Plan], executor: Executor, *, lane_issues_shard: bool = False, allocator: Allocator = EXACT
) -> tuple[HookFootprint, ...]:
    """``backward_memory``'s hooks."""
    return backward_memory(plans, executor, lane_issues_shard=lane_issues_shard, allocator=allocator).hooks
