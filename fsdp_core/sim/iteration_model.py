"""What one simulated iteration is made of: each unit's costs (``UnitCosts``, ``CollectiveCosts``),
the model of the iteration (``IterationModel``: plans, all-gather schedule, cost model, executor),
how links and compute slow each other (``LinkModel``, ``ComputeSlowdown``), and builders of models
from a real model's units (``model_of_units``, ``flops_compute_ms``) or equal nominal units
(``unit_plans``). ``fsdp_core.sim.iteration`` simulates them; ``fsdp_core.sim.iteration_timeline``
holds the result."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

import torch

from fsdp_core.memory.activation_trace import ActivationTrace
from fsdp_core.memory.model_memory import UnitSpec
from fsdp_core.memory.plan_memory import Executor
from fsdp_core.plan.carry import step_flags
from fsdp_core.plan.comm import CommVolume, ring_bytes
from fsdp_core.plan.ops import (
    Group,
)
from fsdp_core.plan.planner import build_plan, plan_post_backward
from fsdp_core.plan.request import Plan, PlanRequest
from fsdp_core.sim.costs import CostModel
from fsdp_core.sim.links import Link
from fsdp_core.spec.config import BackwardPrefetch, HybridAllReduce, ShardingStrategy, StepFlags
from fsdp_core.spec.layout import FlatParamLayout, ShardingSpec
from fsdp_core.unshard.schedule import PerUnitGathers, UnshardRequest, per_param_unshard_request, unshard_request

__all__ = [
    "Activity",
    "CollectiveCosts",
    "ComputeSlowdown",
    "IterationModel",
    "LinkModel",
    "UnitCosts",
    "describe_plans",
    "event_check_volume",
    "flops_compute_ms",
    "model_of_units",
    "unit_plans",
]


class Activity(enum.Enum):
    """What an interval of the simulated timeline is doing."""

    FORWARD_ALL_GATHER = "forward_all_gather"
    FORWARD = "forward"
    BACKWARD_ALL_GATHER = "backward_all_gather"
    BACKWARD = "backward"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ELEMENTWISE = "elementwise"
    """A post-backward plan's casts, padding, divisions, accumulation and offload copies, on the
    plan's streams (priced only by a ``CostModel``)."""
    EVENT_CHECK = "event_check"
    """The shell's check at the end of every backward that each rank ran the same FSDP events
    (``IterationModel.event_check``): an all-gather of one int64 per rank, the host waiting."""

    @property
    def is_collective(self) -> bool:
        """Whether the activity is a transfer (not compute)."""
        return self not in (Activity.FORWARD, Activity.BACKWARD, Activity.ELEMENTWISE)


def _check_ms(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}.{name}: expected a finite number of ms >= 0, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveCosts:
    """One unit's collectives, each timed alone (nothing else on its link), in ms.

    ``*_intra_ms``: over a shard group inside one node (HSDP); ``*_inter_ms``: over a group that
    spans nodes (FSDP's shard group, or the replicate group for the all-reduce). The all-gather
    gathers the unit's flat parameter, the reduce-scatter reduces its gradient, the all-reduce
    reduces one shard of it over the replicate group.
    """

    all_gather_intra_ms: float
    all_gather_inter_ms: float
    reduce_scatter_intra_ms: float
    reduce_scatter_inter_ms: float
    all_reduce_inter_ms: float
    all_reduce_intra_ms: float | None = None
    """An all-reduce inside one node (``NO_SHARD``'s, or a replicate group that fits in a node);
    None: not given, and a plan that needs it is refused by ``simulate_iteration``."""

    def __post_init__(self) -> None:
        for name in (
            "all_gather_intra_ms",
            "all_gather_inter_ms",
            "reduce_scatter_intra_ms",
            "reduce_scatter_inter_ms",
            "all_reduce_inter_ms",
        ):
            _check_ms("CollectiveCosts", name, getattr(self, name))
        if self.all_reduce_intra_ms is not None:
            _check_ms("CollectiveCosts", "all_reduce_intra_ms", self.all_reduce_intra_ms)

    def all_gather_ms(self, link: Link) -> float:
        """The all-gather's cost alone on ``link``."""
        return self.all_gather_inter_ms if link is Link.INTER_NODE else self.all_gather_intra_ms

    def reduce_scatter_ms(self, link: Link) -> float:
        """The reduce-scatter's cost alone on ``link``."""
        return self.reduce_scatter_inter_ms if link is Link.INTER_NODE else self.reduce_scatter_intra_ms

    def all_reduce_ms(self, link: Link) -> float:
        """The all-reduce's cost alone on ``link``; ``ValueError`` when it is not given."""
        if link is Link.INTER_NODE:
            return self.all_reduce_inter_ms
        if self.all_reduce_intra_ms is None:
            raise ValueError("CollectiveCosts.all_reduce_intra_ms: a plan all-reduces inside a node; give its cost")
        return self.all_reduce_intra_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitCosts:
    """One FSDP unit: its compute on the compute stream and its collectives, in ms."""

    name: str
    """A label for tables and traces (``enc0``, ``dec5``, ``root``)."""
    forward_ms: float
    backward_ms: float
    collectives: CollectiveCosts | None = None
    """Its collectives' costs as given (the seed's figures); None: the ``IterationModel``'s
    ``CostModel`` prices every op of its plan from the bytes it moves, element-wise ops too."""
    post_forward_ranks: int = 0
    """A ``fully_shard`` unit that reshards to groups of this many consecutive ranks after
    forward (hpZ): backward gathers it over such a group (``UnitSpec.post_forward_ranks``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"UnitCosts.name: expected a non-empty string, got {self.name!r}")
        _check_ms("UnitCosts", "forward_ms", self.forward_ms)
        _check_ms("UnitCosts", "backward_ms", self.backward_ms)
        if self.collectives is not None and not isinstance(self.collectives, CollectiveCosts):
            raise TypeError(f"UnitCosts.collectives: expected None or CollectiveCosts, got {self.collectives!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class IterationModel:
    """The model: its units, their post-backward plans, where the ranks are, and FSDP1's
    prefetch settings."""

    units: tuple[UnitCosts, ...]
    """In forward order. ``units[0]`` is the root, which wraps the others (as
    ``UnshardRequest.chain`` records it): gathered first in forward, kept gathered into backward,
    its own backward run after all the others'."""
    plans: tuple[Plan | None, ...]
    """Each unit's post-backward plan, as the shell runs it (``unit_plans`` makes nominal ones);
    None for a unit with no parameters: nothing gathered or reduced. One sharding for all."""
    ranks_per_node: int = 8
    """Consecutive ranks per node: which groups fit in one (``group_link``)."""
    cost: CostModel = CostModel()
    """What prices the ops of units without given ``CollectiveCosts``."""
    unshard: UnshardRequest | None = None
    """The orders the shell recorded (``fsdp_shell.predict`` records them from a traced step),
    with their reshard and prefetch settings; None: a chain, ``units[0]`` the root wrapping the
    rest, resharding after forward, with the prefetch settings below."""
    executor: Executor = Executor.STREAMS
    """``STREAMS``: a device's streams (``fsdp_core.sim.iteration``'s docstring). ``CPU_LANE``: the CPU runtime
    (``fsdp_shell.runtime.cpu``): each plan op runs where ``plan_memory`` places it, on the host
    thread (which does the compute, and issues and waits for a shard-group collective), on the
    lane thread (the replicate all-reduce and what must wait for it), or on the host after it
    has waited for the lane; at each plan's start the host waits for the lane work of plans more
    than ``PLANS_IN_FLIGHT`` back; an all-gather runs on gloo's threads unless
    ``fsdp_core.execution.gather_waits``, when the host waits for it."""
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    gathered_at_start: frozenset[int] = frozenset()
    """Units whose unsharded parameter the previous forward-backward left gathered (inside
    ``no_sync()``, the strategies that do not reshard after forward keep it: FSDP1's
    ``_should_free_in_backward``): their ``Gather`` issues no all-gather until they are resharded."""
    event_check: bool = False
    """Whether the backward ends as the shell's does: after the last post-backward hook the host
    all-gathers one int64 per rank over every rank of the plans' world and waits for it
    (``fsdp_shell.safety.agreement.check_same_events``: did every rank run the same events?;
    not in a world of one rank), on the intra-node link when the world fits in one node, else the
    inter-node one; it costs ``event_check_ms``, or, when that is None, what ``cost`` prices an
    all-gather of that output at. FSDP1 has no such check."""
    event_check_ms: float | None = None
    """The event check's measured ms (its own collective, timed alone: a fit of the
    parameters' all-gathers need not hold at 8 bytes per rank); None: priced by ``cost``."""

    def __post_init__(self) -> None:
        if not isinstance(self.units, tuple) or not self.units or not all(isinstance(u, UnitCosts) for u in self.units):
            raise TypeError(f"IterationModel.units: expected a non-empty tuple of UnitCosts, got {self.units!r}")
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ValueError(f"IterationModel.units: names must be unique, got {names}")
        if not isinstance(self.plans, tuple) or not all(p is None or isinstance(p, Plan) for p in self.plans):
            raise TypeError(f"IterationModel.plans: expected a tuple of Plan or None, got {self.plans!r}")
        if len(self.plans) != len(self.units):
            raise ValueError(f"IterationModel.plans: expected one per unit ({len(self.units)}), got {len(self.plans)}")
        shardings = {p.request.sharding.with_rank(0) for p in self.plans if p is not None}
        if len(shardings) > 1:
            raise ValueError("IterationModel.plans: every plan needs the same sharding")
        if not isinstance(self.cost, CostModel):
            raise TypeError(f"IterationModel.cost: expected a CostModel, got {self.cost!r}")
        if self.unshard is not None:
            r = self.unshard
            if r.units != len(self.units):
                raise ValueError(f"IterationModel.unshard: {r.units} units, expected {len(self.units)}")
            if (r.backward_prefetch, r.forward_prefetch) != (self.backward_prefetch, self.forward_prefetch):
                raise ValueError("IterationModel.unshard: its prefetch settings differ from the model's")
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"IterationModel.ranks_per_node: expected an int >= 1, got {self.ranks_per_node!r}")
        if self.backward_prefetch is not None and not isinstance(self.backward_prefetch, BackwardPrefetch):
            raise TypeError(
                f"IterationModel.backward_prefetch: expected None or a BackwardPrefetch, got {self.backward_prefetch!r}"
            )
        if not isinstance(self.forward_prefetch, bool):
            raise TypeError(f"IterationModel.forward_prefetch: expected a bool, got {self.forward_prefetch!r}")
        if not isinstance(self.event_check, bool):
            raise TypeError(f"IterationModel.event_check: expected a bool, got {self.event_check!r}")
        if self.event_check_ms is not None:
            _check_ms("IterationModel", "event_check_ms", self.event_check_ms)
        if not isinstance(self.gathered_at_start, frozenset) or not all(
            isinstance(u, int) and not isinstance(u, bool) and 0 <= u < len(self.units) for u in self.gathered_at_start
        ):
            raise ValueError(
                f"IterationModel.gathered_at_start: expected a frozenset of unit indices in 0..{len(self.units) - 1}, "
                f"got {self.gathered_at_start!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeSlowdown:
    """How many times slower each collective progresses while the compute stream is busy
    (``fsdp_core.sim.links``), named as ``CollectiveCosts``' costs: ``*_intra`` over a shard group
    inside one node, ``*_inter`` over a group that spans nodes. Each >= 1; 1 (the default):
    compute does not slow it, as on GPUs, where NCCL's kernels take few SMs. Above 1 where ranks
    share processor cores with their communication; measured by timing the collective alone and
    while every rank computes (``fsdp_core.sim.calibration.links_from_measurements``)."""

    all_gather_intra: float = 1.0
    all_gather_inter: float = 1.0
    reduce_scatter_intra: float = 1.0
    reduce_scatter_inter: float = 1.0
    all_reduce_inter: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "all_gather_intra",
            "all_gather_inter",
            "reduce_scatter_intra",
            "reduce_scatter_inter",
            "all_reduce_inter",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < math.inf:
                raise ValueError(f"ComputeSlowdown.{name}: expected a finite number >= 1, got {value!r}")

    def of(self, activity: Activity, link: Link) -> float:
        """The factor of a collective ``activity`` on ``link`` (an all-reduce uses the inter-node one)."""
        inter = link is Link.INTER_NODE
        match activity:
            case Activity.FORWARD_ALL_GATHER | Activity.BACKWARD_ALL_GATHER | Activity.EVENT_CHECK:
                return self.all_gather_inter if inter else self.all_gather_intra
            case Activity.REDUCE_SCATTER:
                return self.reduce_scatter_inter if inter else self.reduce_scatter_intra
            case Activity.ALL_REDUCE:
                return self.all_reduce_inter
            case Activity.FORWARD | Activity.BACKWARD | Activity.ELEMENTWISE:
                raise ValueError(f"activity: expected a collective, got {activity.value}")
            case _:
                assert_never(activity)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkModel:
    """How collectives share links and process groups; the free parameters of the network."""

    contention: float = 1.0
    """When ``k >= 2`` collectives are active on one link, together they progress at the link's
    capacity divided by ``contention``, each at ``1/k`` of that. 1: ideal processor sharing
    (bandwidth split, nothing lost); must be >= 1."""
    inter_node_bandwidth: float = 1.0
    """The inter-node link's bandwidth relative to the one at which the ``*_inter_ms`` costs were
    timed (the seed's ``NCCL_CROSS_NIC=1`` row sets it to the fitted cross-NIC factor)."""
    intra_node_bandwidth: float = 1.0
    """The same for the ``*_intra_ms`` costs."""
    one_collective_per_group: bool = True
    """A process group runs one collective at a time, in the order the host issued them
    (ProcessGroupNCCL's one internal stream per group). False: collectives issued from different
    streams run at once even on one group, and share their link (ProcessGroupGloo, whose worker
    threads run a group's asynchronous collectives side by side)."""
    cross_link_slowdown: float = 1.0
    """While any collective is active on the inter-node link, each intra-node one progresses this
    many times slower (``fsdp_core.sim.links``). 1: the links are independent, as NVLink and the
    network are. Above 1 where intra-node collectives are the processor's work and an inter-node
    one takes some of it; measured by timing an intra-node collective alone and beside an
    inter-node all-reduce (``fsdp_core.sim.calibration.links_from_measurements``). Must be >= 1."""
    compute_slowdown: ComputeSlowdown = ComputeSlowdown()
    """How much each collective is slowed while the compute stream is busy; all 1 by default."""
    transfers_slow_compute: float = 1.0
    """How many times slower compute (and the host's element-wise work) progresses while any
    collective is active (``fsdp_core.sim.links``). 1: not slowed, as on GPUs. Above 1 where a
    rank's collectives are its own processor's work (gloo: the worker threads run on the core the
    rank computes on); measured by timing compute alone and beside collectives. Must be >= 1."""

    def __post_init__(self) -> None:
        if not isinstance(self.compute_slowdown, ComputeSlowdown):
            raise TypeError(f"LinkModel.compute_slowdown: expected a ComputeSlowdown, got {self.compute_slowdown!r}")
        at_least_one = ("contention", "cross_link_slowdown", "transfers_slow_compute")
        for name in (*at_least_one, "inter_node_bandwidth", "intra_node_bandwidth"):
            value = getattr(self, name)
            low = 1.0 if name in at_least_one else math.nextafter(0.0, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < math.inf:
                bound = ">= 1" if name in at_least_one else "> 0"
                raise ValueError(f"LinkModel.{name}: expected a finite number {bound}, got {value!r}")
        if not isinstance(self.one_collective_per_group, bool):
            raise TypeError(
                f"LinkModel.one_collective_per_group: expected a bool, got {self.one_collective_per_group!r}"
            )


def unit_plans(
    units: int,
    strategy: ShardingStrategy,
    world_size: int,
    shard_size: int | None = None,
    *,
    hybrid_all_reduce: HybridAllReduce = HybridAllReduce.ASYNC,
    numel: int = 1,
) -> tuple[Plan, ...]:
    """``units`` equal nominal plans (one fp32 parameter of ``numel`` elements each): the plans of
    a model whose collectives are priced per unit (``CollectiveCosts``), where only their ops'
    order, streams and groups matter."""
    sharding = ShardingSpec.for_world(strategy, world_size, shard_size)
    layout = FlatParamLayout.of([("w", (numel,))], torch.float32)
    plan = plan_post_backward(layout, sharding, hybrid_all_reduce=hybrid_all_reduce)
    return (plan,) * units


def describe_plans(plans: Sequence[Plan | None]) -> str:
    """The strategy and geometry of ``plans``, and where a hybrid all-reduce runs."""
    plan = next((p for p in plans if p is not None), None)
    if plan is None:
        return "no plans"
    sharding, r = plan.request.sharding, plan.request
    if sharding.strategy.is_hybrid:
        return (
            f"{sharding.strategy.name} {sharding.replicate_size} x {sharding.shard_size}, "
            f"{r.hybrid_all_reduce.value} all-reduce"
        )
    return f"{sharding.strategy.name} over {sharding.shard_size}"


def event_check_volume(sharding: ShardingSpec) -> CommVolume:
    """The all-gather that ends the shell's backward (``IterationModel.event_check``): one int64
    per rank over every rank of ``sharding``'s world. Its ``group`` says ``SHARD`` only because
    ``Group`` has no name for every rank; the simulator picks its link from ``group_size``."""
    ranks = sharding.shard_size * sharding.replicate_size
    return CommVolume(
        op_index=-1,
        collective="all_gather",
        op="all_gather",
        group=Group.SHARD,
        group_size=ranks,
        input_numel=1,
        output_numel=ranks,
        dtype=torch.int64,
        bytes=ring_bytes("all_gather", ranks, ranks, torch.int64),
    )


def model_of_units(
    units: Sequence[UnitSpec | None],
    trace: ActivationTrace,
    *,
    root: int,
    compute_ms: Sequence[tuple[float, float]],
    cost: CostModel = CostModel(),
    ranks_per_node: int = 8,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = False,
    sync: bool = True,
    follows_no_sync: bool = False,
    executor: Executor = Executor.STREAMS,
    event_check: bool = True,
    event_check_ms: float | None = None,
    fully_shard: PerUnitGathers | None = None,
) -> IterationModel:
    """The iteration of a model's real units (``fsdp_core.memory.UnitSpec``, as the wrapper
    builds them): each unit's post-backward plan (inside ``no_sync()`` when not ``sync``: no
    communication), the all-gather schedule's orders as ``trace`` recorded them, each unit's
    forward and backward ``compute_ms`` (``flops_compute_ms`` of the traced FLOPs, or measured),
    collectives and element-wise ops priced by ``cost``, run by ``executor``. A unit with no
    parameters, or only frozen ones, has no plan here.

    ``follows_no_sync``: the forward-backward after one inside ``no_sync()`` (the second and later
    of an accumulation window). Each plan starts with what the ``no_sync`` plan handed off (its
    ``carried_out``: the unsharded gradient to add), and where the strategy keeps the unsharded
    parameters inside ``no_sync()`` (``ShardingStrategy.reshards_after_backward``: the ZeRO-2
    ones) every unit starts gathered (``IterationModel.gathered_at_start``): no all-gathers.
    ``event_check``: the backward ends with the shell's event check (``IterationModel.event_check``),
    as every backward the shell runs does, ``no_sync()`` ones included, costing ``event_check_ms``
    when given. ``fully_shard``: ``fully_shard`` units' settings (``ModelMemoryRequest``'s), whose
    all-gathers are ``per_param_unshard_request``'s."""
    if len(compute_ms) != len(units):
        raise ValueError(f"compute_ms: expected one (forward, backward) per unit ({len(units)}), got {len(compute_ms)}")
    specs = [u for u in units if u is not None]
    strategy = specs[0].request.sharding.strategy
    forward_order = tuple(u for u in trace.forward_order if units[u] is not None)
    backward_order = tuple(u for u in trace.backward_order if units[u] is not None)
    if fully_shard is not None:
        unshard = per_param_unshard_request(
            units=len(units),
            root=root,
            forward_order=forward_order,
            backward_order=backward_order,
            gathers=fully_shard,
        )
    else:
        unshard = unshard_request(
            units=len(units),
            root=root,
            forward_order=forward_order,
            backward_order=backward_order,
            strategy=strategy,
            low_precision=any(u.request.compute_dtype != u.request.layout.dtype for u in specs),
            sync_gradients=sync,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
        )
    costs = tuple(
        UnitCosts(
            name=(u.name if u is not None and u.name else f"unit {index}") if index != root else "root",
            forward_ms=forward,
            backward_ms=backward,
            post_forward_ranks=0 if u is None else u.post_forward_ranks,
        )
        for index, (u, (forward, backward)) in enumerate(zip(units, compute_ms))
    )

    def flags(request: PlanRequest) -> StepFlags:
        if not follows_no_sync:
            return StepFlags(sync_gradients=sync)
        handed = build_plan(dataclasses.replace(request, flags=StepFlags(sync_gradients=False))).carried_out
        return step_flags(frozenset(() if handed is None else (handed,)), sync_gradients=sync, requires_all_reduce=True)

    plans = tuple(
        None if u is None or not u.trainable else build_plan(dataclasses.replace(u.request, flags=flags(u.request)))
        for u in units
    )
    kept = follows_no_sync and not strategy.reshards_after_backward(False)
    return IterationModel(
        units=costs,
        plans=plans,
        ranks_per_node=ranks_per_node,
        cost=cost,
        unshard=unshard,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        executor=executor,
        gathered_at_start=frozenset(i for i, p in enumerate(plans) if p is not None) if kept else frozenset(),
        event_check=event_check,
        event_check_ms=event_check_ms,
    )


def flops_compute_ms(
    trace: ActivationTrace, units: int, root: int, flops_per_second: float
) -> tuple[tuple[float, float], ...]:
    """Each unit's forward and backward ms at ``flops_per_second`` sustained, from the FLOPs
    ``trace`` counted (``ActivationTrace.unit_flops``)."""
    if isinstance(flops_per_second, bool) or not 0 < flops_per_second < math.inf:
        raise ValueError(f"flops_per_second: expected a positive number, got {flops_per_second!r}")
    return tuple(
        (forward / flops_per_second * 1e3, backward / flops_per_second * 1e3)
        for forward, backward in trace.unit_flops(units, root)
    )
