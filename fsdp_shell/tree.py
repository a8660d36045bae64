"""One FSDP tree's shared state, and how it is made from the constructor's arguments.

A ``Tree`` holds four lifetimes apart:

- made once at construction and never reassigned: the validated ``options``, the process
  ``groups``, the ``device``, the ``runtime`` and its collective ``log``, every unit's flat
  parameter (``handles``, by unit index, the root last), the verifying plan cache, the all-gather
  schedule (``unshard``) and the state-dict entries;
- made once on first use: the ``control`` group, the ``sequencer``, the ``mesh``;
- ``settings``: the user's per-step choices, one frozen value the wrapper's API replaces whole;
- ``iteration``: this iteration's progress, from the root's forward to the end of its backward,
  one value the hooks update and that is replaced whole when a backward ends or is abandoned.

``make_tree`` resolves the groups, the device and the runtime (collectives when groups must be
made: every rank calls it) after ``fsdp_shell.options.parse_options`` has validated everything
that needs no process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import (
    CommHook,
    Division,
    HookEvent,
    InputRole,
    Plan,
    PlanCache,
    PlanRequest,
    ShardingSpec,
    StepFlags,
    step_flags,
)
from fsdp_core.execution import lane_issues_shard
from fsdp_shell.options import Ignored, Options
from fsdp_shell.runtime.collectives import CollectiveLog
from fsdp_shell.runtime.device import checked_device_id, default_device, make_runtime
from fsdp_shell.runtime.groups import ProcessGroups, duplicate_group, group_timeout, resolve_groups
from fsdp_shell.runtime.interpreter import CommHookFn, PlanRun
from fsdp_shell.runtime.protocol import Runtime
from fsdp_shell.safety import stale_optimizer
from fsdp_shell.safety.sequencer import Sequencer
from fsdp_shell.state.state_dict import StateDictSettings, StateEntry, state_entries
from fsdp_shell.units.build import UnitSite, build_handles, find_units, param_names
from fsdp_shell.units.flat_param import FlatParamHandle
from fsdp_shell.units.init import broadcast_states, cast_buffers, materialize, move_states
from fsdp_shell.units.unshard import UnshardRunner

__all__ = ["IterationState", "Settings", "Tree", "make_tree"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """The user's per-step choices; the wrapper's API replaces the value whole."""

    sync_gradients: bool = True
    """False inside ``no_sync()``: backwards accumulate locally, communicating nothing."""
    requires_all_reduce: bool = True
    """Hybrid only, ``set_requires_all_reduce(False)``: the replicate all-reduce is deferred."""
    division: Division
    """Where the average's division goes (``division_policy``, ``set_gradient_divide_factor``)."""
    comm_hook: CommHookFn | None = None
    """The registered communication hook, bound to its state."""
    comm_hook_kind: CommHook = CommHook.NONE
    """What the plans call it."""
    state_dict: StateDictSettings = StateDictSettings()
    """What ``state_dict()`` returns now (``FSDP.state_dict_type``)."""

    def request(self, base: PlanRequest, flags: StepFlags = StepFlags()) -> PlanRequest:
        """A unit's post-backward plan request (``base``: the unit's own) under these settings
        and this step's ``flags``; ``ValueError``/``TypeError`` for a combination the core
        refuses."""
        return dataclasses.replace(base, flags=flags, division=self.division, comm_hook=self.comm_hook_kind)


@dataclass(slots=True)
class IterationState:
    """One iteration's progress, from the root's forward to the end of its backward."""

    events: list[HookEvent] = field(default_factory=list)
    """The FSDP events run so far (without the sequencer: compared across ranks at the end of
    backward)."""
    backward_started: bool = False
    """Whether the end-of-backward callback is queued."""
    unsharded_for_backward: set[int] = field(default_factory=set)
    """Units whose pre-backward ran (their parameters were gathered for backward)."""
    runs: list[tuple[int, PlanRun]] = field(default_factory=list)
    """Each unit reduced this backward with its plan run, in the order they were reduced; the
    end of backward runs their deferred ops."""
    reduced_virtually: set[int] = field(default_factory=set)
    """Units this rank reduced with a zero gradient (``ranks_may_diverge``)."""

    @property
    def unfinished(self) -> bool:
        """Whether a backward started and did not finish."""
        return self.backward_started or bool(self.runs)


@dataclass(eq=False)
class Tree:
    """State shared by every unit of one FSDP tree, owned by the root (see the module's
    docstring for which field lives how long)."""

    options: Options
    groups: ProcessGroups
    device: torch.device
    runtime: Runtime
    log: CollectiveLog
    handles: tuple[FlatParamHandle | None, ...]
    """Every unit's flat parameter by unit index (None: the unit owns no parameter); the root's
    is the last."""
    unshard: UnshardRunner
    state_entries: tuple[StateEntry, ...]
    """The unwrapped module's ``state_dict()`` keys and where each value lives."""
    settings: Settings
    paths: tuple[str, ...] = ()
    """Every unit's module path in the unwrapped model by unit index ("" for the root)."""
    ignored_params: tuple[tuple[str, nn.Parameter], ...] = ()
    """The parameters FSDP leaves alone (``ignored_modules``/``ignored_states``) with their names."""
    root: int = field(init=False)
    """The root unit's index: the last."""
    plans: PlanCache = field(default_factory=lambda: PlanCache(verify=True))
    """Every post-backward plan of the tree, verified once when first built."""
    iteration: IterationState = field(default_factory=IterationState)
    first_forward_done: bool = False
    """Whether the root's first forward has run: the ranks have agreed, the configuration is fixed."""
    summoning: int = 0
    """How many ``summon_full_params`` blocks of this tree are open."""
    agreement_seconds: float = 0.0
    """How long the ranks' agreement took at the first forward."""
    _step_plans: tuple[Settings | None, dict[tuple[int, frozenset[InputRole]], Plan]] = field(
        default_factory=lambda: (None, {}), repr=False
    )
    """The plans of the settings in force, by unit and carried roles (``step_plan``)."""

    def __post_init__(self) -> None:
        self.root = len(self.handles) - 1

    def step_plan(self, unit: int, roles: frozenset[InputRole]) -> Plan:
        """Unit ``unit``'s post-backward plan this step, given the roles it carries: built and
        verified (``plans``) the first time the pair is seen under the settings in force, one
        dictionary lookup after that; the settings are replaced whole when the user changes one,
        which starts afresh."""
        s = self.settings
        owner, plans = self._step_plans
        if owner is not s:
            plans = {}
            self._step_plans = (s, plans)
        plan = plans.get((unit, roles))
        if plan is None:
            h = self.handles[unit]
            assert h is not None
            flags = step_flags(roles, sync_gradients=s.sync_gradients, requires_all_reduce=s.requires_all_reduce)
            plan = plans[(unit, roles)] = self.plans(s.request(h.request, flags))
        return plan

    @property
    def flat_handles(self) -> list[FlatParamHandle]:
        """The units that hold parameters, in unit order."""
        return [h for h in self.handles if h is not None]

    def where(self, unit: int) -> str:
        """``unit`` for people: "the root", or "unit 3 (holding blocks.3.lin.weight)"."""
        label = "the root" if unit == self.root else f"unit {unit}"
        h = self.handles[unit]
        if h is not None and h.layout.params:
            label += f" (holding {h.layout.params[0].name})"
        return label

    def prefix(self, unit: int) -> str:
        """The unwrapped model's ``state_dict()`` key prefix of ``unit``'s entries ("" for the root)."""
        path = self.paths[unit]
        return f"{path}." if path else ""

    @cached_property
    def control(self) -> dist.ProcessGroup:
        """A gloo group of the ranks that must agree (the world when the FSDP groups cover it,
        else the shard group) that nothing else uses: the agreement check and the event
        sequencer's host-side collectives can never interleave with a model collective issued
        by another thread on the same group. Made on first use (a collective of those ranks
        only), with the shard group's timeout, so a rank waiting in it gives up when one waiting
        in a model collective does."""
        covered = self.groups.shard_size * self.groups.replicate_size
        timeout = group_timeout(self.groups.shard)
        group: dist.ProcessGroup
        if covered == dist.get_world_size():
            group = dist.new_group(backend="gloo", timeout=timeout)
        else:
            ranks = dist.get_process_group_ranks(self.groups.shard)
            group = dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
        return group

    @cached_property
    def sequencer(self) -> Sequencer | None:
        """With ``ranks_may_diverge``: the event sequencer over the control group."""
        return Sequencer(self.control, self.root) if self.options.ranks_may_diverge else None

    @cached_property
    def mesh(self) -> DeviceMesh:
        """The shard group as a 1-D ``DeviceMesh`` (sharded state dicts)."""
        return DeviceMesh.from_group(self.groups.shard, self.device.type)


def make_tree(
    module: nn.Module,
    options: Options,
    *,
    process_group: object,
    device_mesh: object,
    device_id: object,
    is_wrapped: Callable[[nn.Module], bool],
    ignored: Ignored | None = None,
) -> tuple[Tree, list[UnitSite]]:
    """The tree for ``module`` and where its units are (the root last). Flattens every unit's
    parameters; submodules already wrapped (``is_wrapped``) and what is ``ignored`` are left alone."""
    device = checked_device_id(device_id)
    groups = resolve_groups(options.strategy, process_group, device_mesh, "cpu" if device is None else device.type)
    if device is None:
        device = default_device(groups)
    if lane_issues_shard(options.hybrid_all_reduce) and device.type == "cpu":
        # the CPU lane issues shard-group reductions too: the all-gathers get a group of their own
        groups = dataclasses.replace(groups, gather=duplicate_group(groups.shard))
    ignored = Ignored() if ignored is None else ignored
    outside = is_wrapped
    if ignored.modules:
        outside = lambda m: is_wrapped(m) or ignored.skips(m)  # noqa: E731
    materialize(module, options.param_init_fn, device, outside)
    names = param_names(module)
    entries = state_entries(module, names, ignored.params)
    move_states(module, device, outside)
    if options.sync_module_states:
        broadcast_states(
            module,
            (groups.shard,) if groups.replicate is None else (groups.shard, groups.replicate),
            outside,
            ignored.params,
        )
    cast_buffers(module, options.mixed_precision.buffer_dtype, outside)
    log = CollectiveLog()
    runtime = make_runtime(device, groups, log)
    division = Division(policy=options.division_policy, backend=groups.caps)
    sharding = ShardingSpec(
        strategy=options.strategy,
        shard_size=groups.shard_size,
        replicate_size=groups.replicate_size,
        rank=groups.shard.rank(),
    )
    sites = find_units(module, options.wrap, outside, ignored.params)
    originals = list(module.named_parameters())
    path_of = {id(m): name for name, m in module.named_modules()}
    handles = build_handles(
        sites,
        names,
        options,
        division=division,
        sharding=sharding,
        runtime=runtime,
        shard_group=groups.shard,
        device=device,
        is_wrapped=outside,
        ignored=ignored.params,
    )
    if not options.use_orig_params:
        flattened = {p.fqn for h in handles if h is not None for p in h.params}
        stale_optimizer.watch((name, p) for name, p in originals if name in flattened)
    strategy = options.strategy
    unshard = UnshardRunner(
        handles,
        len(handles) - 1,
        strategy=strategy,
        low_precision=any(h.compute_dtype != h.orig_dtype for h in handles if h is not None),
        backward_prefetch=options.backward_prefetch,
        forward_prefetch=options.forward_prefetch,
    )
    tree = Tree(
        options=options,
        groups=groups,
        device=device,
        runtime=runtime,
        log=log,
        handles=handles,
        unshard=unshard,
        state_entries=entries,
        settings=Settings(division=division),
        paths=tuple(path_of[id(site.module)] for site in sites),
        ignored_params=tuple((name, p) for name, p in originals if id(p) in ignored.params),
    )
    return tree, sites
