"""A whole model's memory per rank, by phase and by category, from the plans that will run.

Two sides make up what a rank holds while it trains:

- **FSDP's side**, derived here from the units' layouts (``UnitSpec``): the sharded parameters;
  the unsharded ones as the all-gather schedule (``plan_unshard`` of the recorded orders) gathers
  and reshards them (``GatherWalk``); every post-backward plan's buffers (``backward_memory``,
  the plans of each backward in the order their hooks fire, with the flags the carried gradients
  imply); the gradients carried between backwards (the ``no_sync`` accumulation, the reduced
  shards until ``zero_grad``); the optimizer's state and a step's temporaries
  (``fsdp_core.memory.optimizer``); the module's buffers; on an accelerator, the math
  libraries' workspaces (``fsdp_core.memory.workspace``).
- **autograd's side**, the one input the plans cannot give: everything the model's own ops
  hold (inputs, activations saved for backward, the gradients flowing back, each unit's new
  unsharded gradient until its post-backward hook takes it), as an ``ActivationTrace``: the
  bytes at every FSDP hook and at the step's phase boundaries (``Mark``), and the highest
  between them. The shell records one from a forward and backward under ``FakeTensorMode``
  (``fsdp_shell.predict``), with no memory behind it; ``ActivationTrace.chain`` makes one from
  bytes given per unit.

``model_memory`` walks one training step through both in program order: each hook's FSDP
actions at the autograd bytes when it fires, then the autograd peak until the next hook over
what FSDP holds after it. A step is ``accumulate`` forward-backwards (all but the last inside
``no_sync``, or all reducing), an optimizer step and ``zero_grad(set_to_none=True)``; the figures are those of
the steady state (a second step, the optimizer's state made by the first). Everything is for
the rank the units' ``ShardingSpec`` names (``for_rank``); padding makes ranks differ.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import assert_never

import torch

from fsdp_core.execution import lane_issues_shard
from fsdp_core.memory.activation_trace import ActivationTrace, Mark
from fsdp_core.memory.allocator import EXACT, Allocator
from fsdp_core.memory.optimizer import OptimizedTensor, OptimizerSpec, optimizer_state_bytes, optimizer_step_bytes
from fsdp_core.memory.plan_memory import Executor, HookFootprint, backward_memory
from fsdp_core.memory.unshard_memory import GatherBytes, GatherWalk, gather_bytes, per_param_gather_bytes
from fsdp_core.plan.carry import step_flags
from fsdp_core.plan.ops import InputRole
from fsdp_core.plan.planner import build_plan
from fsdp_core.plan.request import Plan, PlanRequest
from fsdp_core.spec.config import BackwardPrefetch
from fsdp_core.spec.events import Event, HookEvent
from fsdp_core.spec.per_param import PerParamLayout
from fsdp_core.unshard.schedule import (
    AwaitGather,
    PerUnitGathers,
    UnshardRequest,
    per_param_unshard_request,
    plan_unshard,
    unshard_request,
)

__all__ = [
    "Category",
    "ModelMemory",
    "ModelMemoryRequest",
    "Phase",
    "PhasePeak",
    "UnitSpec",
    "for_rank",
    "model_memory",
    "optimized_tensors",
    "per_param_optimized_tensors",
]


class Phase(enum.Enum):
    """A phase of a training step, as the peaks are reported."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    """``optimizer.step()`` and ``zero_grad()``."""


class Category(enum.Enum):
    """What the bytes of a rank hold."""

    PARAMS_SHARDED = "params_sharded"
    """Every unit's local shard (on the host with offload: not device bytes on an accelerator)."""
    PARAMS_UNSHARDED = "params_unsharded"
    """Unsharded parameters gathered or in flight (prefetch included)."""
    GRADS_CARRIED = "grads_carried"
    """Gradients kept between backwards: the ``no_sync`` accumulation, the reduced shards the
    optimizer steps on."""
    REDUCE = "reduce"
    """What the post-backward plans hold beyond the gradients they found and leave: casts,
    padding, collective buffers, frees the CPU lane returns later."""
    OPTIMIZER_STATE = "optimizer_state"
    OPTIMIZER_STEP = "optimizer_step"
    """A step's temporaries."""
    AUTOGRAD = "autograd"
    """The model's own tensors: inputs, activations, gradients flowing back, each unit's new
    unsharded gradient until its hook takes it."""
    BUFFERS = "buffers"
    """The module's buffers and anything else FSDP leaves alone."""
    WORKSPACE = "workspace"
    """What the accelerator's math libraries keep once a step has run (cuBLAS's workspaces:
    ``fsdp_core.memory.workspace``); none on the CPU."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitSpec:
    """One FSDP unit: its plan request (``flags`` are the step's, decided here) and, for
    reports, its module's path; ``frozen``: the indices of its parameters that get no gradient
    (all of them: the unit is frozen and has no post-backward)."""

    request: PlanRequest
    name: str = ""
    frozen: frozenset[int] = frozenset()
    gathered: PerParamLayout | None = None
    """A ``fully_shard`` unit: every parameter it shards and gathers, those without gradients too
    (``frozen`` indexes these; ``request``'s layout is its reduce layout, the others). None: a
    flat-parameter unit, whose request's layout is all of them."""
    post_forward_ranks: int = 0
    """A ``fully_shard`` unit that reshards to groups of this many ranks after forward
    (``reshard_after_forward`` an int, ZeRO++'s hpZ); 0: none."""

    def __post_init__(self) -> None:
        if not isinstance(self.request, PlanRequest):
            raise TypeError(f"request: expected a PlanRequest, got {type(self.request).__name__}")
        if self.gathered is not None:
            if not self.request.per_param:
                raise ValueError("gathered: only a per-parameter unit (its request's layout a PerParamLayout) has one")
            kept = tuple(p for i, p in enumerate(self.gathered.params) if i not in self.frozen)
            if kept != self.request.layout.params:
                raise ValueError("gathered: its parameters but the frozen ones must be the request's layout's")
        elif self.request.per_param:
            raise ValueError("gathered: a per-parameter unit needs every parameter it gathers (a PerParamLayout)")
        n = self.num_params
        if not all(isinstance(i, int) and 0 <= i < n for i in self.frozen):
            raise ValueError(f"frozen: expected parameter indices in 0..{n - 1}, got {sorted(self.frozen)}")
        if not isinstance(self.post_forward_ranks, int) or self.post_forward_ranks < 0:
            raise ValueError(f"post_forward_ranks: expected an int >= 0, got {self.post_forward_ranks!r}")

    @property
    def num_params(self) -> int:
        """How many parameters the unit has, frozen ones too."""
        return len(self.request.layout.params if self.gathered is None else self.gathered.params)

    @property
    def trainable(self) -> bool:
        """Whether any of its parameters gets a gradient."""
        return len(self.frozen) < self.num_params

    def gather(self, allocator: Allocator = EXACT) -> GatherBytes:
        """What its all-gathers hold (``fsdp_core.memory.unshard_memory``)."""
        if self.gathered is None:
            return gather_bytes(self.request, allocator)
        return per_param_gather_bytes(
            self.gathered, self.request.compute_dtype, allocator, post_forward_ranks=self.post_forward_ranks
        )

    def sharded_bytes(self, allocator: Allocator = EXACT) -> int:
        """The bytes of this rank's shards: one flat shard, or each parameter's padded shard."""
        r = self.request
        if self.gathered is None:
            return allocator.size(r.shard_numel * r.layout.dtype.itemsize)
        g = self.gathered
        return sum(
            allocator.size(math.prod(g.padded_sharded_shape(i)) * g.dtype.itemsize) for i in range(len(g.params))
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelMemoryRequest:
    """Everything ``model_memory`` depends on."""

    units: tuple[UnitSpec | None, ...]
    """By unit index (None: a unit that owns no parameter); every spec for the same rank and
    with one strategy."""
    root: int
    trace: ActivationTrace
    optimizer: OptimizerSpec = OptimizerSpec()
    optimizer_order: tuple[tuple[int, int], ...] | None = None
    """The order in which the optimizer steps its tensors (``optimized_tensors``); None: units in
    order."""
    accumulate: int = 1
    """Forward-backwards per optimizer step; all but the last inside ``no_sync()`` (``no_sync``)."""
    no_sync: bool = True
    """False: every forward-backward of the step reduces, the later ones accumulating into the
    reduced gradient the one before left (gradient accumulation without ``no_sync()``, as
    torchtitan accumulates)."""
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    executor: Executor = Executor.STREAMS
    allocator: Allocator = EXACT
    buffers: int = 0
    """Device bytes of the module's buffers and of what FSDP leaves alone."""
    workspace: int = 0
    """Device bytes the math libraries keep (``Workspaces.bytes``), counted in every phase."""
    fully_shard: PerUnitGathers | None = None
    """``fully_shard`` units (their specs ``gathered``): what each unit's settings make of its
    all-gathers; required for them (their schedule is ``per_param_unshard_request``'s), None for
    flat-parameter units."""
    accumulating_trace: ActivationTrace | None = None
    """Autograd's side of a forward-backward after one inside ``no_sync``, where units that
    restore their kept gradients (``PlanRequest.restores_pending``) have them in ``.grad`` from
    their pre-backward hook on; None: ``trace`` for every forward-backward."""

    def __post_init__(self) -> None:
        specs = [u for u in self.units if u is not None]
        if not specs:
            raise ValueError("units: expected at least one unit with parameters")
        per_param = {u.gathered is not None for u in specs}
        if len(per_param) != 1:
            raise ValueError("units: expected flat-parameter units or fully_shard units, not both")
        if per_param == {True} and (
            self.fully_shard is None or len(self.fully_shard.forward_reshards) != len(self.units)
        ):
            raise ValueError(
                f"fully_shard: expected PerUnitGathers with one forward_reshards bool per unit ({len(self.units)}) "
                f"for fully_shard units, got {self.fully_shard!r}"
            )
        if per_param == {False} and self.fully_shard is not None:
            raise ValueError("fully_shard: only fully_shard units (specs with gathered) take it")
        if not 0 <= self.root < len(self.units):
            raise ValueError(f"root: expected a unit index below {len(self.units)}, got {self.root}")
        shardings = {dataclasses.replace(u.request.sharding, rank=0) for u in specs}
        if len(shardings) != 1 or len({u.request.sharding.rank for u in specs}) != 1:
            raise ValueError("units: every unit needs the same sharding and rank")
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"accumulate: expected an int >= 1, got {self.accumulate!r}")
        if self.accumulating_trace is not None and not self.no_sync:
            raise ValueError("accumulating_trace: only for forward-backwards after one inside no_sync (no_sync=True)")
        if not isinstance(self.workspace, int) or isinstance(self.workspace, bool) or self.workspace < 0:
            raise ValueError(f"workspace: expected an int >= 0 (bytes), got {self.workspace!r}")
        for unit in (*self.trace.forward_order, *self.trace.backward_order):
            if not 0 <= unit < len(self.units):
                raise ValueError(f"trace: unit {unit} is not one of the {len(self.units)} units")
        for unit in self.trace.post_backward_order:
            if not 0 <= unit < len(self.units) or self.units[unit] is None:
                raise ValueError(f"trace: unit {unit} has no parameters here, so no post-backward hook")

    @property
    def unshard(self) -> UnshardRequest:
        """The all-gather schedule's request from the trace's orders, as the shell records it on its
        first forward-backward (inside ``no_sync`` when accumulating)."""
        specs = [u for u in self.units if u is not None]
        if self.fully_shard is not None:
            return per_param_unshard_request(
                units=len(self.units),
                root=self.root,
                forward_order=tuple(u for u in self.trace.forward_order if self.units[u] is not None),
                backward_order=tuple(u for u in self.trace.backward_order if self.units[u] is not None),
                gathers=self.fully_shard,
            )
        return unshard_request(
            units=len(self.units),
            root=self.root,
            forward_order=tuple(u for u in self.trace.forward_order if self.units[u] is not None),
            backward_order=tuple(u for u in self.trace.backward_order if self.units[u] is not None),
            strategy=specs[0].request.sharding.strategy,
            low_precision=any(u.request.compute_dtype != u.request.layout.dtype for u in specs),
            sync_gradients=self.accumulate == 1 or not self.no_sync,
            backward_prefetch=self.backward_prefetch,
            forward_prefetch=self.forward_prefetch,
        )


def for_rank(units: Sequence[UnitSpec | None], rank: int) -> tuple[UnitSpec | None, ...]:
    """``units`` seen from ``rank`` of the shard group."""
    return tuple(None if u is None else dataclasses.replace(u, request=_with_rank(u.request, rank)) for u in units)


def _with_rank(request: PlanRequest, rank: int) -> PlanRequest:
    return dataclasses.replace(request, sharding=request.sharding.with_rank(rank))


def optimized_tensors(
    units: Sequence[UnitSpec | None], order: Sequence[tuple[int, int]] | None = None
) -> tuple[OptimizedTensor, ...]:
    """What the optimizer steps on this rank: each trainable unit's flat shard, or with
    ``use_orig_params`` each trainable original parameter's view in this rank's shard (a
    parameter it holds none of has no gradient, so no state). ``order``: ``(unit, parameter
    index)`` pairs in the optimizer's order (the index is ignored for flat shards); None: units
    in order, their parameters in order."""
    if order is None:
        order = [(u, i) for u, spec in enumerate(units) if spec is not None for i in range(spec.num_params)]
    out: list[OptimizedTensor] = []
    flat_done: set[int] = set()
    for unit, index in order:
        u = units[unit]
        if u is None or not u.trainable:
            continue
        r = u.request
        if u.gathered is not None:
            if 0 <= index < len(u.gathered.params) and index not in u.frozen:
                out.append(_local_shard(u.gathered, index, r.sharding.rank, r.grad_dtype))
            continue
        if not r.use_orig_params:
            if unit not in flat_done:
                flat_done.add(unit)
                numel = r.shard_numel
                out.append(OptimizedTensor(numel=numel, dtype=r.layout.dtype, grad_dtype=r.grad_dtype))
            continue
        views = {v.param_index: v for v in r.shard_views()}
        v = views.get(index)
        if v is not None and index not in u.frozen:
            out.append(OptimizedTensor(numel=v.numel, dtype=r.layout.dtype, grad_dtype=r.grad_dtype))
    return tuple(out)


def per_param_optimized_tensors(
    layout: PerParamLayout, rank: int, grad_dtype: torch.dtype, frozen: frozenset[int] = frozenset()
) -> tuple[OptimizedTensor, ...]:
    """What the optimizer steps on ``rank`` for a per-parameter (``fully_shard``) unit: each
    trainable parameter's local shard (its ``DTensor``'s local tensor, without the padding: on
    its shard dimension the rows ``rank`` holds, possibly none), in layout order; ``frozen``:
    the indices of parameters without gradients, not optimized."""
    return tuple(_local_shard(layout, i, rank, grad_dtype) for i in range(len(layout.params)) if i not in frozen)


def _local_shard(layout: PerParamLayout, index: int, rank: int, grad_dtype: torch.dtype) -> OptimizedTensor:
    """Parameter ``index``'s local shard on ``rank``, unpadded, as the optimizer steps it."""
    return OptimizedTensor(
        numel=math.prod(layout.sharded_shape(index, rank)), dtype=layout.dtype, grad_dtype=grad_dtype
    )


@dataclass(frozen=True, slots=True)
class PhasePeak:
    """The highest bytes of one phase: ``micro`` is which forward-backward of the accumulation
    window (-1 for the optimizer), ``at`` the hook or boundary where it was reached (None: in the
    optimizer step) with its ``unit``'s index (-1 for none), and what the bytes hold."""

    phase: Phase
    micro: int
    bytes: int
    at: HookEvent | Mark | None
    breakdown: Mapping[Category, int]

    @property
    def unit(self) -> int:
        """The unit of the hook where the peak was reached (-1: none)."""
        return self.at.unit if isinstance(self.at, HookEvent) else -1


@dataclass(frozen=True, slots=True)
class ModelMemory:
    """One rank's bytes in the steady state (module docstring)."""

    peaks: tuple[PhasePeak, ...]
    """Forward and backward of each forward-backward of the step, then the optimizer."""
    after_step: Mapping[Category, int]
    """What is held between steps (after ``zero_grad``)."""

    @property
    def peak(self) -> PhasePeak:
        """The step's highest (the first of equals)."""
        return max(self.peaks, key=lambda p: p.bytes)

    def phase_peak(self, phase: Phase) -> PhasePeak:
        """``phase``'s highest over the accumulation window."""
        return max((p for p in self.peaks if p.phase is phase), key=lambda p: p.bytes)


def model_memory(request: ModelMemoryRequest) -> ModelMemory:
    """The steady-state bytes of ``request``'s rank by phase and category (module docstring)."""
    walk = _StepWalk(request)
    walk.step(record=False)
    return walk.step(record=True)


class _StepWalk:
    """FSDP's side of one rank through training steps, against the trace."""

    def __init__(self, r: ModelMemoryRequest) -> None:
        self.r = r
        self.specs = r.units
        specs = [u for u in r.units if u is not None]
        self.strategy = specs[0].request.sharding.strategy
        self.use_orig_params = specs[0].request.use_orig_params
        self.schedule = plan_unshard(r.unshard)
        self.per_param = specs[0].gathered is not None
        self.gather = [GatherBytes(0) if u is None else u.gather(r.allocator) for u in r.units]
        self.gathers = GatherWalk(self.gather)
        on_device = r.executor is Executor.CPU_LANE
        self.fixed = {
            Category.PARAMS_SHARDED: sum(
                u.sharded_bytes(r.allocator) for u in specs if on_device or not u.request.offload.offload_params
            ),
            Category.BUFFERS: r.buffers,
            Category.WORKSPACE: r.workspace,
        }
        optimized = optimized_tensors(r.units, r.optimizer_order)
        optimizer_on_device = on_device or not any(u.request.offload.offload_params for u in specs)
        self.state_bytes = (
            optimizer_state_bytes(r.optimizer, optimized, host_is_device=on_device, allocator=r.allocator)
            if optimizer_on_device
            else 0
        )
        self.step_bytes = optimizer_step_bytes(r.optimizer, optimized, r.allocator) if optimizer_on_device else 0
        self.optimizer_state = 0
        self.carried: list[dict[InputRole, int]] = [{} for _ in r.units]
        self.reduce = 0
        """Bytes the plans hold beyond the gradients they found and left (``Category.REDUCE``)."""
        self.zeroed = False
        """With ``use_orig_params``: ``zero_grad`` dropped the gradients' views since the last
        forward, so the root's next forward frees what they showed (``reclaim(at_forward=True)``)."""
        self.lane_issues_shard = lane_issues_shard(specs[0].request.hybrid_all_reduce)
        self.peaks: dict[tuple[Phase, int], PhasePeak] = {}
        self.recording = False
        """Whether this step's peaks are kept (the steady-state one)."""

    # -- the bytes -------------------------------------------------------------------------------

    def breakdown(self, autograd: int, **extra: int) -> dict[Category, int]:
        out = dict.fromkeys(Category, 0)
        out.update(self.fixed)
        out[Category.PARAMS_UNSHARDED] = self.gathers.live
        out[Category.GRADS_CARRIED] = sum(sum(c.values()) for c in self.carried)
        out[Category.REDUCE] = self.reduce
        out[Category.OPTIMIZER_STATE] = self.optimizer_state
        out[Category.AUTOGRAD] = autograd
        for name, value in extra.items():
            out[Category(name)] += value
        return out

    def note(self, phase: Phase | None, micro: int, at: HookEvent | Mark | None, parts: dict[Category, int]) -> None:
        if phase is None or not self.recording:
            return
        total = sum(parts.values())
        key = (phase, micro)
        best = self.peaks.get(key)
        if best is None or total > best.bytes:
            self.peaks[key] = PhasePeak(phase, micro, total, at, MappingProxyType(parts))

    def reshards_at_end_of_backward(self, unit: int, sync: bool) -> bool:
        """Whether the end of this backward frees ``unit``'s unsharded parameters: a
        ``fully_shard`` unit's own setting (the schedule's request), else the strategy's rule for
        a synchronising backward or one inside ``no_sync``."""
        if self.per_param:
            return self.schedule.request.reshards_at_end_of_backward(unit)
        return self.strategy.reshards_after_backward(sync)

    # -- a step ----------------------------------------------------------------------------------

    def step(self, *, record: bool) -> ModelMemory:
        self.recording = record
        self.peaks = {}
        for micro in range(self.r.accumulate):
            self.forward_backward(micro, sync=micro == self.r.accumulate - 1 or not self.r.no_sync)
        last = self.r.trace.points[-1].live
        self.optimizer_state = self.state_bytes
        self.note(Phase.OPTIMIZER, -1, None, self.breakdown(last, optimizer_step=self.step_bytes))
        if self.use_orig_params:
            self.zeroed = True
        else:
            self.carried = [{} for _ in self.carried]
        after = self.breakdown(last)
        keys = sorted(self.peaks, key=lambda k: (k[1] < 0, k[1], k[0] is Phase.BACKWARD))
        ordered = tuple(self.peaks[k] for k in keys)
        return ModelMemory(ordered, MappingProxyType(after))

    def plans(self, sync: bool) -> list[Plan]:
        """This backward's plans in the order their hooks fire, each with the flags its unit's
        carried gradients imply (a unit's carried state changes only at its own hook)."""
        out = []
        for unit in self.r.trace.post_backward_order:
            spec = self.specs[unit]
            assert spec is not None
            roles = frozenset(self.carried[unit])
            if spec.request.restores_pending:  # in .grad by its hook, where autograd adds into it
                roles -= {InputRole.PENDING_UNSHARDED}
            flags = step_flags(roles, sync_gradients=sync, requires_all_reduce=True)
            out.append(build_plan(dataclasses.replace(spec.request, flags=flags)))
        return out

    def forward_backward(self, micro: int, *, sync: bool) -> None:
        r = self.r
        hooks: Iterator[tuple[Plan, HookFootprint]] = iter(())
        returned_at_end = 0
        phase: Phase | None = None
        trace = r.accumulating_trace if micro > 0 and r.accumulating_trace is not None else r.trace
        for point in trace.points:
            at = point.at
            if isinstance(at, Mark):
                phase = {Mark.FORWARD_START: Phase.FORWARD, Mark.BACKWARD_START: Phase.BACKWARD}.get(at)
                if at is Mark.BACKWARD_START:
                    plans = self.plans(sync)
                    backward = backward_memory(
                        plans,
                        r.executor,
                        lane_issues_shard=self.lane_issues_shard,
                        allocator=r.allocator,
                        unsharded=[self.gather[u].unsharded for u in r.trace.post_backward_order]
                        if self.per_param
                        else None,
                    )
                    hooks, returned_at_end = iter(zip(plans, backward.hooks)), backward.returned_at_end
                self.note(phase, micro, at, self.breakdown(point.live))
                self.note(phase, micro, at, self.breakdown(point.peak))
                continue
            event, unit = at
            match event:
                case Event.PRE_FORWARD | Event.PRE_BACKWARD:
                    if event is Event.PRE_FORWARD and unit == r.root and self.zeroed:
                        self.carried = [{} for _ in self.carried]
                        self.zeroed = False
                    spec = self.specs[unit]
                    own = spec is not None
                    if event is Event.PRE_BACKWARD and spec is not None and spec.request.restores_pending:
                        self.carried[unit].pop(InputRole.PENDING_UNSHARDED, None)  # autograd's (the trace's) now
                    peak, net = self.gathers.run_all(
                        (*self.schedule.actions(event, unit), AwaitGather(unit=unit)) if own else ()
                    )
                    self.note(phase, micro, at, self.breakdown(point.live, params_unsharded=peak - net))
                case Event.POST_FORWARD:
                    peak, net = self.gathers.run_all(self.schedule.actions(event, unit))
                    self.note(phase, micro, at, self.breakdown(point.live, params_unsharded=peak - net))
                case Event.POST_BACKWARD:
                    plan, hook = next(hooks)
                    self.note(phase, micro, at, self.breakdown(point.live, reduce=hook.peak))
                    carried = self.carried[unit]
                    before = sum(carried.values())
                    for role in plan.consumed:
                        carried.pop(role, None)
                    if plan.carried_out is not None:
                        carried[plan.carried_out] = hook.memory.handed_off
                    unsharded = hook.memory.unsharded
                    if plan.should_free_in_backward:
                        self.gathers.resharded(unit)
                    self.reduce += hook.net + point.taken + unsharded - (sum(carried.values()) - before)
                    peak, net = self.gathers.run_all(self.schedule.actions(event, unit))
                    after = point.live - point.taken
                    self.note(phase, micro, at, self.breakdown(after, params_unsharded=peak - net))
                case Event.END_BACKWARD:
                    self.reduce -= returned_at_end
                    for index, spec in enumerate(self.specs):
                        if spec is not None and self.reshards_at_end_of_backward(index, sync):
                            self.gathers.resharded(index)
                    self.note(phase, micro, at, self.breakdown(point.live))
                case Event.END_FORWARD:
                    pass
                case _:
                    assert_never(event)
            self.note(phase, micro, at, self.breakdown(point.peak))
