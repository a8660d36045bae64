"""A static verifier: prove a plan sound before anything runs, or list every reason it is not.

The verifier walks the ops once, keeping for every stream a vector clock (which work of every
other stream it is known to run after) and for every buffer what it holds: where it was
allocated, its last write, its reads since, which streams the allocator was told about, and an
abstract value (over which groups it has been reduced, by what it has been scaled, whether it
covers the whole gradient or one shard). It does not trust the planner: what the hand-off must
look like is worked out again from the request.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import assert_never

import torch

from fsdp_core.plan.ops import (
    Accumulate,
    AllReduce,
    AllReduceHookCall,
    Buffer,
    Cast,
    CommHookCall,
    CopyIn,
    Destination,
    Device,
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
    Stream,
    WaitStream,
    op_name,
)
from fsdp_core.plan.request import Plan, PlanRequest
from fsdp_core.problems import Problem, Rule
from fsdp_core.spec.division import ReduceKind, ReduceOpSpec
from fsdp_core.spec.layout import ShardView

__all__ = ["check_plan", "expected_destination"]


class Coverage(enum.Enum):
    FULL = "full"
    SHARD = "shard"


@dataclass(slots=True)
class _Value:
    """The abstract content of a buffer."""

    reductions: Counter[Group]
    scale: float | None
    coverage: Coverage
    sources: frozenset[InputRole] = frozenset()
    """The inputs whose gradients this buffer's value includes."""

    def copy(self) -> _Value:
        return _Value(Counter(self.reductions), self.scale, self.coverage, self.sources)


@dataclass(slots=True)
class _BufState:
    buffer: Buffer
    alloc_stream: Stream
    alloc_index: int
    last_write: tuple[Stream, int]
    value: _Value
    reads: list[tuple[Stream, int]] = field(default_factory=list)
    uses: list[tuple[Stream, int]] = field(default_factory=list)
    recorded: set[Stream] = field(default_factory=set)
    freed_at: int | None = None
    is_input: bool = False
    ever_read: bool = False


@dataclass(frozen=True, slots=True)
class _Expect:
    destination: Destination
    reductions: Counter[Group]
    coverage: Coverage
    numel: int
    dtype: torch.dtype
    device: Device
    total_divisor: float | None
    inputs: frozenset[InputRole]
    views: tuple[ShardView, ...] | None
    input_buffers: dict[InputRole, tuple[int, torch.dtype, Device]]
    reshards: bool


def expected_destination(r: PlanRequest) -> Destination:
    """Where the gradient must end up for ``r``, worked out from the flags alone."""
    f = r.flags
    if not f.sync_gradients:
        return Destination.UNSHARDED_GRAD
    if r.sharding.strategy.is_hybrid and not f.requires_all_reduce:
        return Destination.PARTIAL
    if r.offload.offload_params:
        return Destination.CPU_GRAD
    if f.accumulate:
        return Destination.ACCUMULATED_GRAD
    return Destination.SHARDED_GRAD


def _expect(r: PlanRequest) -> _Expect:
    f = r.flags
    dest = expected_destination(r)
    total = r.layout.total_numel
    shard = r.shard_numel
    compute = (
        r.layout.dtype
        if (f.force_full_precision or r.mixed_precision.param_dtype is None)
        else r.mixed_precision.param_dtype
    )
    reshards = r.should_free_in_backward
    buffers: dict[InputRole, tuple[int, torch.dtype, Device]] = {
        InputRole.GRAD: (total, compute, Device.DEVICE),
        InputRole.PENDING_UNSHARDED: (total, r.pending_dtype, Device.DEVICE),
        InputRole.PENDING_PARTIAL: (shard, r.reduce_dtype, Device.DEVICE),
    }
    inputs = {InputRole.GRAD}
    if f.pending_unsharded:
        inputs.add(InputRole.PENDING_UNSHARDED)
    match dest:
        case Destination.UNSHARDED_GRAD:
            views = r.unsharded_views() if r.exposes_views else None
            return _Expect(
                dest,
                Counter(),
                Coverage.FULL,
                total,
                r.pending_dtype,
                Device.DEVICE,
                1.0,
                frozenset(inputs),
                views,
                buffers,
                reshards,
            )
        case Destination.PARTIAL:
            if f.pending_partial:
                inputs.add(InputRole.PENDING_PARTIAL)
            return _Expect(
                dest,
                Counter({Group.SHARD: 1}),
                Coverage.SHARD,
                shard,
                r.reduce_dtype,
                Device.DEVICE,
                None,
                frozenset(inputs),
                None,
                buffers,
                reshards,
            )
        case Destination.SHARDED_GRAD | Destination.ACCUMULATED_GRAD | Destination.CPU_GRAD:
            if f.pending_partial:
                inputs.add(InputRole.PENDING_PARTIAL)
            if f.accumulate:
                inputs.add(InputRole.SHARDED_GRAD)
            return _expect_reduced(r, dest, frozenset(inputs), buffers, reshards)
        case _:
            assert_never(dest)


def _expect_reduced(
    r: PlanRequest,
    dest: Destination,
    inputs: frozenset[InputRole],
    buffers: dict[InputRole, tuple[int, torch.dtype, Device]],
    reshards: bool,
) -> _Expect:
    """What a plan that hands off a reduced gradient (sharded, accumulated or offloaded) must do."""
    strategy = r.sharding.strategy
    total = r.layout.total_numel
    shard = r.shard_numel
    groups = Counter({Group.SHARD: 1})
    if strategy.is_hybrid:
        groups[Group.REPLICATE] = 1
    coverage = Coverage.SHARD if strategy.is_sharded else Coverage.FULL
    numel = shard if strategy.is_sharded else total
    divisor = (
        float(r.sharding.shard_size * r.sharding.replicate_size) if r.division.factor is None else r.division.factor
    )
    device = Device.HOST if r.offload.offload_params else Device.DEVICE
    views = r.shard_views() if r.exposes_views else None
    buffers[InputRole.SHARDED_GRAD] = (numel, r.grad_dtype, device)
    return _Expect(dest, groups, coverage, numel, r.grad_dtype, device, divisor, inputs, views, buffers, reshards)


class _Checker:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.request = plan.request
        self.problems: list[Problem] = []
        self.clock: dict[Stream, dict[Stream, int]] = {s: dict.fromkeys(Stream, 0) for s in Stream}
        self.bufs: dict[str, _BufState] = {}
        self.hand_offs: list[tuple[int, HandOff]] = []
        self.views: list[tuple[int, GradViews]] = []
        self.hook_calls: list[tuple[int, Counter[Group] | None, float | None]] = []
        """Each all-reduce hook call: where, and the reductions and scale of what it was shown."""
        self.input_roles: list[InputRole] = []
        self.index = -1
        self.expect = _expect(plan.request)
        self.reshards = 0

    def report(self, rule: Rule, message: str, index: int | None = None) -> None:
        self.problems.append(Problem(rule=rule, op_index=self.index if index is None else index, message=message))

    # -- streams ----------------------------------------------------------------------------

    def tick(self, stream: Stream) -> tuple[Stream, int]:
        self.clock[stream][stream] += 1
        return stream, self.clock[stream][stream]

    def visible(self, event: tuple[Stream, int], on: Stream) -> bool:
        s, t = event
        return s is on or self.clock[on][s] >= t

    def wait(self, stream: Stream, waits_for: Stream) -> None:
        mine, theirs = self.clock[stream], self.clock[waits_for]
        for s in Stream:
            mine[s] = max(mine[s], theirs[s])

    # -- buffers ----------------------------------------------------------------------------

    def group_size(self, group: Group) -> int:
        return self.request.group_size(group)

    def live(self, b: Buffer) -> _BufState | None:
        st = self.bufs.get(b.name)
        if st is None:
            self.report(Rule.USE_BEFORE_WRITE, f"{b.name} is used before anything produces it")
            return None
        if st.buffer != b:
            rule = (
                Rule.DTYPE_MISMATCH
                if st.buffer.dtype != b.dtype
                else Rule.NUMEL_MISMATCH
                if st.buffer.numel != b.numel
                else Rule.DEVICE_MISMATCH
            )
            self.report(rule, f"{b} disagrees with how it was produced: {st.buffer}")
        if st.freed_at is not None:
            self.report(Rule.USE_AFTER_FREE, f"{b.name} is used after it was freed at op {st.freed_at}")
            return None
        return st

    def read(self, b: Buffer, event: tuple[Stream, int]) -> _BufState | None:
        st = self.live(b)
        if st is None:
            return None
        self.check_ordered(st, event)
        st.reads.append(event)
        st.uses.append(event)
        st.ever_read = True
        return st

    def write_in_place(self, b: Buffer, event: tuple[Stream, int]) -> _BufState | None:
        st = self.live(b)
        if st is None:
            return None
        self.check_ordered(st, event)
        for r in st.reads:
            if not self.visible(r, event[0]):
                self.report(
                    Rule.UNSAFE_REUSE,
                    f"{b.name} is written on {event[0].value} while a read on {r[0].value} may still be running",
                )
        st.reads = []
        st.uses.append(event)
        st.last_write = event
        return st

    def check_ordered(self, st: _BufState, event: tuple[Stream, int]) -> None:
        if not self.visible(st.last_write, event[0]):
            self.report(
                Rule.UNSYNCED_STREAM,
                f"{st.buffer.name} is used on {event[0].value} but was last written on "
                f"{st.last_write[0].value} with no wait in between",
            )

    def produce(self, b: Buffer, event: tuple[Stream, int], value: _Value, *, is_input: bool = False) -> None:
        old = self.bufs.get(b.name)
        if old is not None and old.freed_at is None:
            self.report(
                Rule.REDEFINED, f"{b.name} is produced again while still alive (produced at op {old.alloc_index})"
            )
        elif old is not None and old.buffer != b:
            self.report(Rule.REDEFINED, f"name {b.name} is reused for a different buffer ({old.buffer} then {b})")
        self.bufs[b.name] = _BufState(
            buffer=b,
            alloc_stream=event[0],
            alloc_index=self.index,
            last_write=event,
            value=value,
            uses=[event],
            is_input=is_input,
        )

    # -- ops --------------------------------------------------------------------------------

    def run(self) -> list[Problem]:
        for i, op in enumerate(self.plan.ops):
            self.index = i
            self.step(op)
        self.index = -1
        self.finish()
        return self.problems

    def step(self, op: Op) -> None:
        if self.hand_offs:
            self.report(Rule.HAND_OFF, f"{op_name(op)} comes after the hand-off; the hand-off must be last")
        match op:
            case Input():
                self.op_input(op)
            case WaitStream():
                self.tick(op.stream)
                self.wait(op.stream, op.waits_for)
            case EndOfBackwardWait():
                self.tick(op.stream)
                self.wait(op.stream, op.waits_for)
            case RecordStream():
                self.tick(op.stream)
                st = self.live(op.buffer)
                if st is not None:
                    st.recorded.add(op.stream)
            case Free():
                self.op_free(op)
            case FreeUnshardedParam():
                self.tick(op.stream)
                self.reshards += 1
            case Cast():
                self.op_derive(op.src, op.dst, op.stream, same_numel=True, same_dtype=False)
            case Pad():
                self.op_pad(op)
            case CopyIn():
                self.op_copy_in(op)
            case Divide():
                self.op_divide(op)
            case ReduceScatter():
                self.check_one_rank_op(op.reduce_op, op.group, "reduce_scatter")
                self.op_reduce_scatter(
                    op.src, op.dst, op.group, op.reduce_op.scale(self.group_size(op.group)), op.stream
                )
            case AllReduce():
                self.check_one_rank_op(op.reduce_op, op.group, "all_reduce")
                self.op_all_reduce(op.buffer, op.group, op.reduce_op.scale(self.group_size(op.group)), op.stream)
            case CommHookCall():
                self.op_hook(op)
            case AllReduceHookCall():
                st = self.write_in_place(op.buffer, self.tick(op.stream))
                shown = (None, None) if st is None else (+st.value.reductions, st.value.scale)
                self.hook_calls.append((self.index, *shown))
            case Accumulate():
                self.op_accumulate(op)
            case Offload():
                self.op_offload(op)
            case GradViews():
                self.tick(op.stream)
                self.read(op.buffer, (op.stream, self.clock[op.stream][op.stream]))
                self.views.append((self.index, op))
            case HandOff():
                ev = self.tick(op.stream)
                self.read(op.buffer, ev)
                self.hand_offs.append((self.index, op))
            case _:
                assert_never(op)

    def op_input(self, op: Input) -> None:
        ev = self.tick(op.stream)
        self.input_roles.append(op.role)
        exp = self.expect
        sources = frozenset({op.role})
        match op.role:
            case InputRole.GRAD | InputRole.PENDING_UNSHARDED:
                value = _Value(Counter(), 1.0, Coverage.FULL, sources)
            case InputRole.SHARDED_GRAD:
                scale = None if exp.total_divisor is None else 1.0 / exp.total_divisor
                value = _Value(Counter(exp.reductions), scale, exp.coverage, sources)
            case InputRole.PENDING_PARTIAL:
                value = _Value(Counter({Group.SHARD: 1}), None, Coverage.SHARD, sources)
            case _:
                assert_never(op.role)
        want = exp.input_buffers.get(op.role)
        b = op.buffer
        if want is not None:
            numel, dtype, device = want
            what = f"input {b} ({op.role.value})"
            if b.numel != numel:
                self.report(Rule.NUMEL_MISMATCH, f"{what} should hold {numel} elements")
            if b.dtype != dtype:
                self.report(Rule.DTYPE_MISMATCH, f"{what} should be {dtype}")
            if b.device is not device:
                self.report(Rule.DEVICE_MISMATCH, f"{what} should be in {device.value} memory")
        self.produce(op.buffer, ev, value, is_input=True)

    def op_free(self, op: Free) -> None:
        self.tick(op.stream)
        st = self.live(op.buffer)
        if st is None:
            return
        if op.stream is not st.alloc_stream:
            self.report(
                Rule.UNSAFE_REUSE,
                f"{op.buffer.name} is freed on {op.stream.value} but was allocated on {st.alloc_stream.value}",
            )
        for s, t in st.uses:
            if s is st.alloc_stream or s in st.recorded or self.clock[st.alloc_stream][s] >= t:
                continue
            self.report(
                Rule.UNSAFE_REUSE,
                f"{op.buffer.name} is freed to {st.alloc_stream.value}'s pool while work on {s.value} may "
                f"still use it (no record_stream, no wait)",
            )
            break
        st.freed_at = self.index

    def op_derive(
        self, src: Buffer, dst: Buffer, stream: Stream, *, same_numel: bool, same_dtype: bool
    ) -> _Value | None:
        ev = self.tick(stream)
        st = self.read(src, ev)
        if same_numel and src.numel != dst.numel:
            self.report(Rule.NUMEL_MISMATCH, f"{op_name(self.plan.ops[self.index])} {src} -> {dst} changes the numel")
        if same_dtype and src.dtype != dst.dtype:
            self.report(Rule.DTYPE_MISMATCH, f"{op_name(self.plan.ops[self.index])} {src} -> {dst} changes the dtype")
        if src.device is not dst.device and not isinstance(self.plan.ops[self.index], Offload):
            self.report(Rule.DEVICE_MISMATCH, f"{src} -> {dst} crosses devices outside an offload")
        value = st.value.copy() if st is not None else _Value(Counter(), None, Coverage.FULL)
        self.produce(dst, ev, value)
        return value

    def op_pad(self, op: Pad) -> None:
        if op.dst.numel < op.src.numel:
            self.report(Rule.NUMEL_MISMATCH, f"pad shrinks {op.src} to {op.dst}")
        self.op_derive(op.src, op.dst, op.stream, same_numel=False, same_dtype=True)

    def op_copy_in(self, op: CopyIn) -> None:
        """A per-parameter copy-in reads every unsharded gradient and writes the padded
        rank-major reduce-scatter input (it may cast)."""
        if op.layout != self.request.layout:
            self.report(Rule.NUMEL_MISMATCH, "copy_in lays the gradients out by another unit's layout")
        if op.src.numel != op.layout.total_numel or op.dst.numel != op.layout.padded_numel:
            self.report(
                Rule.NUMEL_MISMATCH,
                f"copy_in {op.src} -> {op.dst}: the layout takes {op.layout.total_numel} elements "
                f"into {op.layout.padded_numel}",
            )
        self.op_derive(op.src, op.dst, op.stream, same_numel=False, same_dtype=False)

    def op_divide(self, op: Divide) -> None:
        ev = self.tick(op.stream)
        if not (math.isfinite(op.factor) and op.factor > 0):
            self.report(Rule.DIVISION, f"divide by {op.factor}")
            return
        st = self.write_in_place(op.buffer, ev)
        if st is not None and st.value.scale is not None:
            st.value.scale /= op.factor

    def check_one_rank_op(self, reduce_op: ReduceOpSpec, group: Group, what: str) -> None:
        """A collective over one rank is a copy (NCCL): it must not be trusted to scale."""
        if self.group_size(group) == 1 and reduce_op.kind is not ReduceKind.SUM:
            self.report(
                Rule.DIVISION,
                f"{what} over the {group.value} group of one rank with {reduce_op}: a one-rank collective "
                "is a copy and may not scale; divide outside it",
            )

    def check_reducible(self, st: _BufState, group: Group, what: str) -> None:
        if st.value.reductions[group] >= 1:
            self.report(Rule.REDUCTION, f"{what} reduces {st.buffer.name} over the {group.value} group a second time")

    def op_reduce_scatter(
        self, src: Buffer, dst: Buffer, group: Group, scale: float, stream: Stream, what: str = "reduce_scatter"
    ) -> None:
        ev = self.tick(stream)
        st = self.read(src, ev)
        size = self.group_size(group)
        if src.dtype != dst.dtype:
            self.report(Rule.DTYPE_MISMATCH, f"{what} input {src} and output {dst} differ in dtype")
        if src.numel != dst.numel * size:
            self.report(Rule.NUMEL_MISMATCH, f"{what} input {src} must be {size} x output {dst}")
        if src.device is not Device.DEVICE or dst.device is not Device.DEVICE:
            self.report(Rule.DEVICE_MISMATCH, f"{what} runs on host memory")
        value = _Value(Counter(), None, Coverage.SHARD)
        if st is not None:
            self.check_reducible(st, group, what)
            if st.value.coverage is not Coverage.FULL:
                self.report(Rule.REDUCTION, f"{what} input {src.name} does not hold the whole gradient")
            if src.numel < self.request.layout.total_numel:
                self.report(
                    Rule.REDUCTION,
                    f"{what} input {src} is smaller than the flat parameter "
                    f"({self.request.layout.total_numel}); some elements would not be reduced",
                )
            value = st.value.copy()
            value.coverage = Coverage.SHARD
            value.reductions[group] += 1
            if value.scale is not None:
                value.scale *= scale
        self.produce(dst, ev, value)

    def op_all_reduce(self, b: Buffer, group: Group, scale: float, stream: Stream, what: str = "all_reduce") -> None:
        ev = self.tick(stream)
        st = self.write_in_place(b, ev)
        if b.device is not Device.DEVICE:
            self.report(Rule.DEVICE_MISMATCH, f"{what} runs on host memory")
        if st is None:
            return
        self.check_reducible(st, group, what)
        if st.value.coverage is Coverage.FULL and b.numel < self.request.layout.total_numel:
            self.report(Rule.REDUCTION, f"{what} of {b} misses part of the flat parameter")
        st.value.reductions[group] += 1
        if st.value.scale is not None:
            st.value.scale *= scale

    def op_hook(self, op: CommHookCall) -> None:
        size = self.group_size(op.group)
        if op.divides_by != size:
            self.report(Rule.DIVISION, f"comm hook divides by {op.divides_by} but its group has {size} ranks")
        if op.src == op.dst:
            self.op_all_reduce(op.src, op.group, 1.0 / op.divides_by, op.stream, "comm_hook")
        else:
            self.op_reduce_scatter(op.src, op.dst, op.group, 1.0 / op.divides_by, op.stream, "comm_hook")

    def op_accumulate(self, op: Accumulate) -> None:
        ev = self.tick(op.stream)
        src = self.read(op.src, ev)
        dst = self.write_in_place(op.dst, ev)
        r = self.request
        # the one widening accumulation: a per-parameter unit's unsharded gradients into their
        # reduce-dtype accumulation (``PlanRequest.pending_dtype``)
        widening = op.src.dtype == r.compute_dtype and op.dst.dtype == r.pending_dtype
        if op.src.dtype != op.dst.dtype and not widening:
            self.report(Rule.DTYPE_MISMATCH, f"accumulate {op.src} into {op.dst}")
        if op.src.numel != op.dst.numel:
            self.report(Rule.NUMEL_MISMATCH, f"accumulate {op.src} into {op.dst}")
        if op.src.device is not op.dst.device:
            self.report(Rule.DEVICE_MISMATCH, f"accumulate {op.src} into {op.dst}")
        if src is not None and dst is not None:
            self.merge(src, dst)

    def merge(self, src: _BufState, dst: _BufState) -> None:
        a, b = src.value, dst.value
        if +a.reductions != +b.reductions or a.coverage is not b.coverage:
            self.report(
                Rule.REDUCTION,
                f"accumulating {src.buffer.name} (reduced over {_groups(a)}) into {dst.buffer.name} "
                f"(reduced over {_groups(b)}) mixes differently reduced gradients",
            )
        if a.scale is not None and b.scale is not None and not math.isclose(a.scale, b.scale, rel_tol=1e-9):
            self.report(
                Rule.DIVISION,
                f"accumulating {src.buffer.name} (scaled {a.scale:.6g}) into {dst.buffer.name} "
                f"(scaled {b.scale:.6g}) mixes differently divided gradients",
            )
        if b.scale is None:
            b.scale = a.scale
        b.sources = a.sources | b.sources

    def op_offload(self, op: Offload) -> None:
        if op.dst.device is not Device.HOST or op.src.device is not Device.DEVICE:
            self.report(Rule.DEVICE_MISMATCH, f"offload must copy device memory to host memory: {op.src} -> {op.dst}")
        if op.accumulate:
            ev = self.tick(op.stream)
            src = self.read(op.src, ev)
            dst = self.write_in_place(op.dst, ev)
            if op.src.dtype != op.dst.dtype or op.src.numel != op.dst.numel:
                self.report(
                    Rule.DTYPE_MISMATCH if op.src.dtype != op.dst.dtype else Rule.NUMEL_MISMATCH,
                    f"offload-accumulate {op.src} into {op.dst}",
                )
            if src is not None and dst is not None:
                self.merge(src, dst)
        else:
            self.op_derive(op.src, op.dst, op.stream, same_numel=True, same_dtype=True)

    # -- the end --------------------------------------------------------------------------

    def finish(self) -> None:
        exp = self.expect
        if self.reshards != (1 if exp.reshards else 0):
            verb = "free the unsharded parameter once" if exp.reshards else "keep the unsharded parameter"
            self.report(
                Rule.RESHARD, f"the strategy and flags say to {verb}; the plan frees it {self.reshards} time(s)"
            )
        if len(self.hand_offs) != 1:
            self.report(Rule.HAND_OFF, f"expected exactly one hand-off, found {len(self.hand_offs)}")
        for role in sorted(exp.inputs - set(self.input_roles), key=lambda r: r.value):
            self.report(Rule.DROPPED_GRADIENT, f"the plan never takes the {role.value} input, so it would be lost")
        for role in sorted(set(self.input_roles) - exp.inputs, key=lambda r: r.value):
            self.report(Rule.DROPPED_GRADIENT, f"the plan takes a {role.value} input the step flags do not provide")
        handed = {h.buffer.name for _, h in self.hand_offs}
        for st in self.bufs.values():
            if st.is_input and not st.ever_read and st.buffer.name not in handed:
                self.report(Rule.DROPPED_GRADIENT, f"input {st.buffer.name} is never read: its gradient is dropped")
            if st.freed_at is None and st.buffer.name not in handed:
                self.report(Rule.LEAK, f"{st.buffer.name} is neither freed nor handed off")
        if len(self.hand_offs) == 1:
            self.check_hand_off(self.hand_offs[0], exp)
        self.check_views(exp)
        self.check_all_reduce_hook(exp)

    def check_all_reduce_hook(self, exp: _Expect) -> None:
        """A unit with an all-reduce hook calls it once on every reduced gradient it hands to the
        optimizer, after the reductions and the division; otherwise never."""
        final = exp.destination in (Destination.SHARDED_GRAD, Destination.ACCUMULATED_GRAD, Destination.CPU_GRAD)
        want = 1 if self.request.all_reduce_hook and final else 0
        if len(self.hook_calls) != want:
            self.report(
                Rule.REDUCTION, f"the all-reduce hook is called {len(self.hook_calls)} time(s), expected {want}"
            )
        for index, reductions, scale in self.hook_calls:
            divided = (
                exp.total_divisor is None or scale is None or math.isclose(scale * exp.total_divisor, 1.0, rel_tol=1e-9)
            )
            if reductions is not None and (reductions != +exp.reductions or not divided):
                self.report(
                    Rule.REDUCTION, "the all-reduce hook is shown a gradient not yet reduced and divided", index
                )

    def check_hand_off(self, where: tuple[int, HandOff], exp: _Expect) -> None:
        index, h = where
        b = h.buffer
        if h.destination is not exp.destination:
            self.report(Rule.HAND_OFF, f"hands off to {h.destination.value}, expected {exp.destination.value}", index)
        if b.dtype != exp.dtype:
            self.report(Rule.DTYPE_MISMATCH, f"hands off {b} in {b.dtype}, the optimizer expects {exp.dtype}", index)
        if b.numel != exp.numel:
            self.report(Rule.NUMEL_MISMATCH, f"hands off {b} with {b.numel} elements, expected {exp.numel}", index)
        if b.device is not exp.device:
            self.report(Rule.DEVICE_MISMATCH, f"hands off {b} on {b.device.value}, expected {exp.device.value}", index)
        if h.stream is not Stream.COMPUTE:
            self.report(Rule.HAND_OFF, f"hands off on {h.stream.value}; the optimizer runs on compute", index)
        st = self.bufs.get(b.name)
        if st is None:
            return
        missing = exp.inputs - st.value.sources
        if missing:
            names = ", ".join(sorted(m.value for m in missing))
            self.report(
                Rule.DROPPED_GRADIENT,
                f"the handed-off {b.name} does not include the {names} gradient: it is dropped",
                index,
            )
        got = +st.value.reductions
        if got != +exp.reductions:
            self.report(
                Rule.REDUCTION,
                f"hands off a gradient reduced over {_groups(st.value)}, expected exactly once over "
                f"{_groups(_Value(exp.reductions, None, exp.coverage))}",
                index,
            )
        if st.value.coverage is not exp.coverage:
            self.report(
                Rule.REDUCTION, f"hands off a {st.value.coverage.value} gradient, expected {exp.coverage.value}", index
            )
        scale = st.value.scale
        if (
            exp.total_divisor is not None
            and scale is not None
            and not math.isclose(scale * exp.total_divisor, 1.0, rel_tol=1e-9)
        ):
            self.report(
                Rule.DIVISION,
                f"the gradient is divided by {1.0 / scale:.6g} in total, expected {exp.total_divisor:.6g}",
                index,
            )

    def check_views(self, exp: _Expect) -> None:
        if exp.views is None:
            for index, _ in self.views:
                self.report(Rule.VIEWS, "grad views without use_orig_params", index)
            return
        if len(self.views) != 1:
            self.report(Rule.VIEWS, f"use_orig_params needs exactly one grad_views op, found {len(self.views)}")
            return
        index, v = self.views[0]
        self.check_views_placement(index, v)
        if self.hand_offs and v.buffer.name != self.hand_offs[0][1].buffer.name:
            self.report(
                Rule.VIEWS, f"views are of {v.buffer.name} but {self.hand_offs[0][1].buffer.name} is handed off", index
            )
        for view in v.views:
            if view.offset_in_buffer < 0 or view.offset_in_buffer + view.numel > v.buffer.numel:
                self.report(Rule.VIEWS, f"view of {view.param_name} lies outside {v.buffer}", index)
        if v.views != exp.views:
            self.report(Rule.VIEWS, "the views do not match this rank's slices of the original parameters", index)

    def check_views_placement(self, index: int, v: GradViews) -> None:
        """The original parameters' ``.grad`` is exposed on compute, once the gradient is final:
        after the end-of-backward waits when the plan has them."""
        if v.stream is not Stream.COMPUTE:
            self.report(
                Rule.VIEWS,
                f"grad views are exposed on {v.stream.value}; the original parameters' .grad is read on compute",
                index,
            )
        if self.plan.callback_ops and index < len(self.plan.hook_ops):
            self.report(
                Rule.VIEWS,
                "grad views are exposed inside the post-backward hook, before the "
                "end-of-backward waits; the gradient is final only after them",
                index,
            )


def _groups(v: _Value) -> str:
    parts = [f"{g.value}x{n}" for g, n in sorted(v.reductions.items(), key=lambda kv: kv[0].value) if n]
    return "{" + ", ".join(parts) + "}" if parts else "nothing"


def check_plan(plan: Plan) -> list[Problem]:
    """Every problem in ``plan``; an empty list means the plan is sound.

    Rules: no buffer used before it is produced or after it is freed, or produced twice while
    alive; every cross-stream use ordered by a wait; no buffer freed or overwritten while
    another stream may still use it, unless ``record_stream`` told the allocator; dtypes,
    numels and devices consistent across every op; every gradient element reduced exactly once
    over each group the strategy requires and divided by exactly the data-parallel size (or the
    user's factor); every input consumed, every buffer freed or handed off; exactly one
    hand-off, last, on compute, in the destination, dtype, numel and device the optimizer
    expects, with the original parameters' views of the handed-off buffer where
    ``use_orig_params`` asks for them, exposed on compute after the end-of-backward waits.
    """
    return _Checker(plan).run()
