"""One FSDP tree's shared state and how it is made from the constructor's arguments.

``parse_options`` validates every argument that does not need a process group, so a bad one
fails before any collective is issued (``duplicate_group`` and DeviceMesh creation are
collectives); ``make_tree`` then resolves the groups, the device and the runtime.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import (
    BackwardPrefetch,
    CommHook,
    CPUOffload,
    Division,
    DivisionPolicy,
    Group,
    HookEvent,
    HybridAllReduce,
    MixedPrecision,
    PlanCache,
    ShardingStrategy,
    Stream,
)
from fsdp_shell.runtime.log import CollectiveLog
from fsdp_shell.options import (
    to_backward_prefetch,
    to_cpu_offload,
    to_division_policy,
    to_hybrid_all_reduce,
    to_mixed_precision,
    to_sharding_strategy,
)
from fsdp_shell.runtime.groups import ProcessGroups, duplicate_group, group_timeout, resolve_groups
from fsdp_shell.runtime.interpreter import CommHookFn, ExecContext, PlanRun
from fsdp_shell.runtime.cpu import CpuRuntime, CudaRuntime, Runtime
from fsdp_shell.safety.sequencer import Sequencer
from fsdp_shell.state.state_dict import StateDictSettings, StateEntry, state_entries
from fsdp_shell.units.unshard import UnshardRunner

if TYPE_CHECKING:
    from fsdp_shell.fsdp import FullyShardedDataParallel

__all__ = ["Options", "Tree", "WrapPolicy", "make_tree", "parse_options", "wrap_policy"]

WrapPolicy = Callable[[nn.Module], bool]


@dataclass(frozen=True)
class Options:
    """The constructor's arguments that shape the whole tree, validated."""

    strategy: ShardingStrategy
    mixed_precision: MixedPrecision
    offload: CPUOffload
    use_orig_params: bool
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    division_policy: DivisionPolicy
    hybrid_all_reduce: HybridAllReduce
    wrap: WrapPolicy | None
    ranks_may_diverge: bool = False


def parse_options(
    *, sharding_strategy: object, cpu_offload: object, auto_wrap_policy: object, mixed_precision: object,
    use_orig_params: object, backward_prefetch: object, forward_prefetch: object, division_policy: object,
    hybrid_all_reduce: object, ranks_may_diverge: object = False,
) -> Options:
    """Every argument checked on its own and against the others; ``ValueError``/``TypeError``
    naming the argument."""
    strategy = to_sharding_strategy(ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy)
    placement = to_hybrid_all_reduce(hybrid_all_reduce)
    if placement is HybridAllReduce.SYNC and not strategy.is_hybrid:
        raise ValueError(f"hybrid_all_reduce: 'sync' places the replicate all-reduce of hybrid strategies; "
                         f"{strategy.name} has none (leave it 'async')")
    return Options(
        strategy=strategy, mixed_precision=to_mixed_precision(mixed_precision), offload=to_cpu_offload(cpu_offload),
        use_orig_params=_flag("use_orig_params", use_orig_params),
        backward_prefetch=to_backward_prefetch(backward_prefetch),
        forward_prefetch=_flag("forward_prefetch", forward_prefetch), division_policy=to_division_policy(division_policy),
        hybrid_all_reduce=placement, wrap=wrap_policy(auto_wrap_policy),
        ranks_may_diverge=_flag("ranks_may_diverge", ranks_may_diverge),
    )


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return value


@dataclass
class Tree:
    """State shared by every unit of one FSDP tree, owned by the root."""

    strategy: ShardingStrategy
    mixed_precision: MixedPrecision
    offload: CPUOffload
    use_orig_params: bool
    groups: ProcessGroups
    device: torch.device
    ctx: ExecContext
    param_names: dict[int, str]
    division: Division
    hybrid_all_reduce: HybridAllReduce = HybridAllReduce.ASYNC
    units: list[FullyShardedDataParallel] = field(default_factory=list)
    comm_hook: CommHookFn | None = None
    comm_hook_kind: CommHook = CommHook.NONE
    sync_gradients: bool = True
    requires_all_reduce: bool = True
    backward_started: bool = False
    runs: list[PlanRun] = field(default_factory=list)
    buffers: list[tuple[str, nn.Module, str]] = field(default_factory=list)
    plans: PlanCache = field(default_factory=lambda: PlanCache(verify=True))
    """Every post-backward plan of the tree, verified once when first built."""
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    unshard: UnshardRunner | None = None
    """The all-gather schedule, made once the root knows every unit."""
    state_entries: tuple[StateEntry, ...] = ()
    """The unwrapped module's ``state_dict()`` keys and where each value lives."""
    state_dict_settings: StateDictSettings = StateDictSettings()
    """What ``state_dict()`` returns now (``FSDP.state_dict_type``)."""
    owners: dict[int, str] = field(default_factory=dict)
    """During construction: which unit flattened each parameter (by ``id``), to refuse a
    parameter shared across units."""
    _mesh: DeviceMesh | None = None
    sequence_events: bool = False
    """Whether the ranks agree on every FSDP event (``ranks_may_diverge``, ``fsdp_shell.safety.sequencer``)."""
    events: list[HookEvent] = field(default_factory=list)
    """Without the sequencer: this iteration's FSDP events, compared across ranks at the end of
    backward."""
    sequencer: Sequencer | None = None
    reduced_virtually: set[int] = field(default_factory=set)
    """Units this rank reduced with a zero gradient in the current backward."""
    agreement_seconds: float | None = None
    """How long the ranks' agreement check took at the first forward (None: not yet run)."""

    _control: dist.ProcessGroup | None = None

    def control(self) -> dist.ProcessGroup:
        """A gloo group of the ranks that must agree (the world when the FSDP groups cover it,
        else the shard group) that nothing else uses: the agreement check and the event
        sequencer's host-side collectives can never interleave with a model collective issued
        by another thread on the same group. Made once (a collective of those ranks only), with
        the shard group's timeout, so a rank waiting in it gives up when one waiting in a
        model collective does."""
        if self._control is None:
            covered = self.groups.shard_size * self.groups.replicate_size
            timeout = group_timeout(self.groups.shard)
            if covered == dist.get_world_size():
                self._control = dist.new_group(backend="gloo", timeout=timeout)
            else:
                ranks = dist.get_process_group_ranks(self.groups.shard)
                self._control = dist.new_group(ranks, backend="gloo", timeout=timeout,
                                               use_local_synchronization=True)
        return self._control

    def mesh(self) -> DeviceMesh:
        """The shard group as a 1-D ``DeviceMesh`` (sharded state dicts), made once."""
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.groups.shard, self.device.type)
        return self._mesh

    def gathers(self) -> UnshardRunner:
        """The all-gather schedule (set at the end of the root's construction)."""
        assert self.unshard is not None
        return self.unshard


def make_tree(module: nn.Module, options: Options, *, process_group: object, device_mesh: object,
              device_id: object) -> Tree:
    """The tree's groups, device, runtime and plan cache for ``module`` (a collective when the
    groups must be made: every rank calls it)."""
    o = options
    device = _checked_device_id(device_id)
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    if not names:
        raise ValueError(f"module: {type(module).__name__} has no parameters; there is nothing to shard")
    entries = state_entries(module, names)
    groups = resolve_groups(o.strategy, process_group, device_mesh, "cpu" if device is None else device.type)
    if device is None:
        device = _default_device(groups)
    own_gathers = o.hybrid_all_reduce is HybridAllReduce.SYNC and device.type != "cuda"
    if own_gathers:
        groups = dataclasses.replace(groups, gather=duplicate_group(groups.shard))
    module.to(device)
    log = CollectiveLog()
    ctx = ExecContext(
        groups={Group.SHARD: groups.shard, **({Group.REPLICATE: groups.replicate} if groups.replicate else {})},
        runtime=_runtime(device, log, lane_issues_shard=own_gathers),
        log=log,
        gloo_reduce_scatter=groups.backend == "gloo",
    )
    tree = Tree(strategy=o.strategy, mixed_precision=o.mixed_precision, offload=o.offload,
                use_orig_params=o.use_orig_params, groups=groups, device=device, ctx=ctx, param_names=names,
                division=Division(policy=o.division_policy, backend=groups.caps),
                hybrid_all_reduce=o.hybrid_all_reduce, backward_prefetch=o.backward_prefetch,
                forward_prefetch=o.forward_prefetch, state_entries=entries, sequence_events=o.ranks_may_diverge)
    for mod_name, mod in module.named_modules():
        for buf_name in mod._buffers:
            if mod._buffers[buf_name] is not None:
                tree.buffers.append((f"{mod_name}.{buf_name}" if mod_name else buf_name, mod, buf_name))
    return tree


def wrap_policy(auto_wrap_policy: object) -> WrapPolicy | None:
    """``auto_wrap_policy`` as a predicate on modules; ``TypeError`` naming it otherwise."""
    if auto_wrap_policy is None:
        return None
    if isinstance(auto_wrap_policy, type) and issubclass(auto_wrap_policy, nn.Module):
        raise TypeError(f"auto_wrap_policy: got the class {auto_wrap_policy.__name__} itself; pass a set of classes, "
                        f"{{{auto_wrap_policy.__name__}}}, or ModuleWrapPolicy({{{auto_wrap_policy.__name__}}})")
    classes = getattr(auto_wrap_policy, "_module_classes", None)
    if classes is not None:
        auto_wrap_policy = set(classes)
    if isinstance(auto_wrap_policy, (set, frozenset, list, tuple)):
        kinds = tuple(auto_wrap_policy)
        if not all(isinstance(k, type) and issubclass(k, nn.Module) for k in kinds):
            raise TypeError("auto_wrap_policy: a set must hold nn.Module classes")
        return lambda m: isinstance(m, kinds)
    if callable(auto_wrap_policy):
        policy = auto_wrap_policy
        return lambda m: bool(policy(m))
    raise TypeError(
        "auto_wrap_policy: expected None, a set of nn.Module classes, a callable(module) -> bool, "
        f"or torch's ModuleWrapPolicy; got {auto_wrap_policy!r}"
    )


def _checked_device_id(device_id: object) -> torch.device | None:
    """``device_id`` as FSDP1 takes it (None, a CUDA index, a ``torch.device``), checked against
    this machine before any process group is touched."""
    if device_id is None:
        return None
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        device_id = torch.device("cuda", device_id)
    if not isinstance(device_id, torch.device):
        raise TypeError(f"device_id: expected None, an int or a torch.device, got {device_id!r}")
    if device_id.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device_id: {device_id} names a CUDA device, but CUDA is not available here; "
                             "pass None or torch.device('cpu')")
        if device_id.index is not None and not 0 <= device_id.index < count:
            raise ValueError(f"device_id: {device_id} does not exist; this machine has CUDA devices 0..{count - 1}")
    return device_id


def _default_device(groups: ProcessGroups) -> torch.device:
    """FSDP1's default without ``device_id``: the current CUDA device with NCCL, else the CPU."""
    if groups.backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _runtime(device: torch.device, log: CollectiveLog, *, lane_issues_shard: bool) -> Runtime:
    """CUDA streams for the plan streams on a GPU; the host thread and the lane on the CPU
    (where the lane may also issue shard-group reductions when the all-gathers have a group of
    their own: then a reduction queued behind a sync all-reduce does not block the host)."""
    if device.type != "cuda":
        return CpuRuntime(log, lane_may_issue=frozenset({Group.SHARD}) if lane_issues_shard else frozenset())
    with torch.cuda.device(device):
        streams: dict[Stream, torch.cuda.Stream] = {Stream.COMPUTE: torch.cuda.current_stream()}
        for s in Stream:
            if s is not Stream.COMPUTE:
                streams[s] = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch.cuda.Stream is unannotated
        return CudaRuntime(streams)
