"""A whole model's memory per rank, predicted before launch: ``predict_memory``.

The model (built on the meta device, or real: it is left as it was) is taken apart as the
wrapper would take it (``find_units``, ``unit_params``, ``unit_request``: the same code, with
no process group), one step is recorded under ``FakeTensorMode`` (``record_trace``), and
``fsdp_core.memory.model_memory`` derives every rank's bytes by phase from the units' plans,
the all-gather schedule and the trace. ``backend="gloo"`` predicts the CPU runtime (exact
bytes, the lane's deferred frees, the optimizer's CPU defaults), ``"nccl"`` an accelerator's
(device streams, CUDA's 512-byte blocks, offloaded states on the host, ``foreach`` steps, the
cuBLAS workspaces).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core import BackendCaps, Division, PerParamLayout, PerUnitGathers, ShardingSpec
from fsdp_core.memory import Executor
from fsdp_core.memory.activation_trace import ActivationTrace
from fsdp_core.memory.allocator import CUDA_CACHING, EXACT, Allocator
from fsdp_core.memory.model_memory import (
    ModelMemory,
    ModelMemoryRequest,
    UnitSpec,
    for_rank,
    model_memory,
)
from fsdp_core.memory.optimizer import OptimizerKind, OptimizerSpec
from fsdp_core.memory.workspace import cuda_workspaces
from fsdp_core.sim import CostModel, IterationTimeline, flops_compute_ms, model_of_units, simulate_iteration
from fsdp_shell.fsdp2.units import (
    Settings,
    managed_params,
    per_param_layout,
    per_param_request,
    reshards_after_forward,
)
from fsdp_shell.options import Options, parse_options
from fsdp_shell.predict.trace import PerParamTraceUnit, StepFn, TraceUnit, record_trace, record_trace_per_param
from fsdp_shell.units.build import OwnedParams, UnitSite, find_units, param_names, unit_params, unit_request

__all__ = ["Prediction", "StepTime", "predict_memory", "predict_time"]

BACKENDS = ("nccl", "gloo")
APIS = ("fsdp1", "fully_shard")


@dataclass(frozen=True, slots=True)
class Prediction:
    """What ``predict_memory`` found: the units (seen from shard rank 0) with their module
    paths (``""`` for the root), autograd's trace, and every shard rank's memory."""

    units: tuple[UnitSpec | None, ...]
    paths: tuple[str, ...]
    trace: ActivationTrace
    ranks: tuple[ModelMemory, ...]
    """By rank in the shard group (one for ``NO_SHARD``: every rank holds the same)."""
    options: Options
    world_size: int
    backend: str
    optimizer: OptimizerSpec
    accumulate: int
    no_sync: bool = True
    """``predict_memory``'s: False, every forward-backward of the step reduces."""
    api: str = "fsdp1"
    """``predict_memory``'s: ``fsdp1`` or ``fully_shard``."""
    fully_shard: PerUnitGathers | None = None
    """``fully_shard``: what each unit's settings make of its all-gathers (``ModelMemoryRequest``'s)."""

    @property
    def worst_rank(self) -> int:
        """The shard rank with the highest peak (the lowest of equals)."""
        return max(range(len(self.ranks)), key=lambda r: (self.ranks[r].peak.bytes, -r))

    @property
    def worst(self) -> ModelMemory:
        """The worst rank's memory."""
        return self.ranks[self.worst_rank]


def predict_memory(
    module: nn.Module,
    step: StepFn,
    *,
    world_size: int,
    shard_size: int | None = None,
    sharding_strategy: object = None,
    mixed_precision: object = None,
    cpu_offload: object = None,
    auto_wrap_policy: object = None,
    use_orig_params: bool = False,
    backward_prefetch: object = "BACKWARD_PRE",
    forward_prefetch: bool = False,
    hybrid_all_reduce: object = "async",
    optimizer: OptimizerKind | str = OptimizerKind.ADAMW,
    accumulate: int = 1,
    no_sync: bool = True,
    backend: str = "nccl",
    workspace: int | None = None,
    api: str = "fsdp1",
    reshard_after_forward: bool | int | None = None,
    explicit_prefetch: bool = False,
) -> Prediction:
    """Every shard rank's bytes by phase for training ``module`` with these arguments (FSDP's
    constructor's, meaning the same) on ``world_size`` ranks, no process group made: each step
    ``accumulate`` forward-backwards (``step`` makes the inputs and returns the loss; all but
    the last inside ``no_sync()``, or with ``no_sync=False`` every one reducing, the later ones
    accumulating into the reduced gradient), ``optimizer.step()`` and ``zero_grad()``. ``workspace``: the
    bytes the GPU's math libraries keep (``Category.WORKSPACE``); None: torch's defaults
    (``cuda_workspaces``) for this machine's GPU, or for an H100/H200 where there is none, under
    this environment; none with ``backend="gloo"``. ``ValueError`` / ``TypeError`` naming a bad
    argument.

    ``api="fully_shard"``: ``fully_shard`` applied to every module the policy wraps, then to
    ``module``, as FSDP2 scripts do (``_predict_fully_shard``): the strategy picks the mesh (a
    hybrid one: (replicate, shard) with ``shard_size``) and whether blocks reshard after forward
    (the ZeRO-2 ones: not), ``reshard_after_forward`` (every call's, an int for hpZ) overriding
    it; ``explicit_prefetch``: each block's forward prefetches the next block and its backward the
    one before (``set_modules_to_forward_prefetch``, ``set_modules_to_backward_prefetch``, as
    torchtitan sets them); ``mixed_precision`` gives ``MixedPrecisionPolicy``'s ``param_dtype`` and
    ``reduce_dtype``, ``cpu_offload`` ``CPUOffloadPolicy``. ``NO_SHARD``, ``use_orig_params``,
    ``forward_prefetch``, a ``backward_prefetch`` (``fully_shard`` has none implicit) and
    ``hybrid_all_reduce`` are refused by name."""
    if api not in APIS:
        raise ValueError(f"api: expected one of {', '.join(APIS)}, got {api!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if workspace is not None and (not isinstance(workspace, int) or isinstance(workspace, bool) or workspace < 0):
        raise ValueError(f"workspace: expected None or an int >= 0 (bytes), got {workspace!r}")
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise ValueError(f"accumulate: expected an int >= 1, got {accumulate!r}")
    kind = optimizer if isinstance(optimizer, OptimizerKind) else OptimizerKind.parse(str(optimizer))
    options = parse_options(
        sharding_strategy=sharding_strategy,
        cpu_offload=cpu_offload,
        auto_wrap_policy=auto_wrap_policy,
        mixed_precision=mixed_precision,
        use_orig_params=use_orig_params,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        division_policy="pre_post",
        hybrid_all_reduce=hybrid_all_reduce,
    )
    if api == "fully_shard":
        return _predict_fully_shard(
            module,
            step,
            options,
            kind=kind,
            world_size=world_size,
            shard_size=shard_size,
            reshard_after_forward=reshard_after_forward,
            explicit_prefetch=explicit_prefetch,
            accumulate=accumulate,
            no_sync=no_sync,
            backend=backend,
            workspace=workspace,
            refused={
                "use_orig_params": use_orig_params is not False,
                "forward_prefetch": forward_prefetch is not False,
                "backward_prefetch": backward_prefetch not in ("BACKWARD_PRE", None),
                "hybrid_all_reduce": hybrid_all_reduce != "async",
            },
        )
    if reshard_after_forward is not None:
        raise ValueError("reshard_after_forward: only api='fully_shard' takes it; FSDP1's strategy decides")
    if explicit_prefetch:
        raise ValueError(
            "explicit_prefetch: only api='fully_shard' takes it; FSDP1's are backward_prefetch and forward_prefetch"
        )
    sharding = ShardingSpec.for_world(options.strategy, world_size, shard_size)
    division = Division(policy=options.division_policy, backend=BackendCaps.for_backend(backend))
    gloo = backend == "gloo"
    allocator: Allocator = EXACT if gloo else CUDA_CACHING
    if workspace is None:
        workspace = 0 if gloo else cuda_workspaces(_capability(), os.environ).bytes

    names = param_names(module)
    sites = find_units(module, options.wrap, lambda m: False)
    owned = unit_params(sites, names, lambda m: False)
    paths = tuple(_paths(module, sites))
    units = tuple(_unit(o, options, division, sharding, path) for o, path in zip(owned, paths))
    trace = record_trace(
        module,
        [
            TraceUnit(site.module, [p for p, _ in o], None if u is None else u.request, bool(u and u.trainable))
            for site, o, u in zip(sites, owned, units)
        ],
        step,
        mixed_precision=options.mixed_precision,
        block=allocator.block,
    )
    buffers = _buffer_bytes(module, options.mixed_precision.buffer_dtype, allocator)
    order = _optimizer_order(module, sites, owned, options.use_orig_params)
    spec = OptimizerSpec(kind=kind, foreach=not gloo)
    ranks = _every_rank(
        ModelMemoryRequest(
            units=units,
            root=len(units) - 1,
            trace=trace,
            optimizer=spec,
            optimizer_order=order,
            accumulate=accumulate,
            no_sync=no_sync,
            backward_prefetch=options.backward_prefetch,
            forward_prefetch=options.forward_prefetch,
            executor=Executor.CPU_LANE if gloo else Executor.STREAMS,
            allocator=allocator,
            buffers=buffers,
            workspace=workspace,
        ),
        sharding.num_shards,
    )
    return Prediction(
        units=units,
        paths=paths,
        trace=trace,
        ranks=ranks,
        options=options,
        world_size=world_size,
        backend=backend,
        optimizer=spec,
        accumulate=accumulate,
        no_sync=no_sync,
    )


def _every_rank(request: ModelMemoryRequest, shards: int) -> tuple[ModelMemory, ...]:
    """``model_memory`` of ``request`` (its units seen from shard rank 0) for each shard rank."""
    return tuple(
        model_memory(dataclasses.replace(request, units=for_rank(request.units, rank))) for rank in range(shards)
    )


def _capability() -> tuple[int, int]:
    """This machine's first CUDA GPU's compute capability, or an H100/H200's without one."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None and accelerator.type == "cuda":
        major, minor = torch.get_device_module(accelerator).get_device_capability(0)
        return int(major), int(minor)
    return (9, 0)


def _unit(
    owned: OwnedParams, options: Options, division: Division, sharding: ShardingSpec, path: str
) -> UnitSpec | None:
    if not owned:
        return None
    frozen = frozenset(i for i, (_, t) in enumerate(owned) if not t.requires_grad)
    return UnitSpec(request=unit_request(owned, options, division, sharding), name=path, frozen=frozen)


def _paths(module: nn.Module, sites: Sequence[UnitSite]) -> list[str]:
    path_of = {id(m): name for name, m in module.named_modules()}
    return [path_of[id(site.module)] for site in sites]


def _buffer_bytes(module: nn.Module, dtype: torch.dtype | None, allocator: Allocator) -> int:
    """Bytes of ``module``'s buffers once FSDP has cast the floating-point ones to ``dtype``."""
    total = 0
    for b in {id(b): b for b in module.buffers()}.values():
        kind = dtype if dtype is not None and torch.is_floating_point(b) else b.dtype
        total += allocator.size(b.numel() * kind.itemsize)
    return total


def _optimizer_order(
    module: nn.Module, sites: Sequence[UnitSite], owned: Sequence[OwnedParams], use_orig_params: bool
) -> tuple[tuple[int, int], ...]:
    """``(unit, parameter index)`` in the order of the wrapped model's ``parameters()``: the
    unwrapped model's with ``use_orig_params``; else each unit's flat parameter where it is
    registered, on the unit's module, visited before the module's children."""
    if use_orig_params:
        where = {id(t): (u, i) for u, o in enumerate(owned) for i, (_, t) in enumerate(o)}
        return tuple(where[id(p)] for p in module.parameters() if id(p) in where)
    unit_of = {id(site.module): u for u, site in enumerate(sites)}
    return tuple((unit_of[id(m)], -1) for m in module.modules() if id(m) in unit_of and owned[unit_of[id(m)]])


@dataclass(frozen=True, slots=True)
class StepTime:
    """A modeled optimizer step: its forward-backwards inside ``no_sync()`` (none without
    accumulation) and the synchronising one, each a simulated iteration. Every forward-backward
    after the window's first starts with what the one before left: its unsharded gradients to
    add and, with a ZeRO-2 strategy, its unsharded parameters (``model_of_units``'
    ``follows_no_sync``)."""

    no_sync: IterationTimeline | None
    """The window's first forward-backward, inside ``no_sync()``; None without accumulation."""
    no_sync_again: IterationTimeline | None
    """Each later one inside ``no_sync()``; None with fewer than 3 per step."""
    sync: IterationTimeline
    """The last, synchronising one (after one inside ``no_sync()`` when accumulating)."""
    accumulate: int
    flops_per_second: float
    cost: CostModel
    synchronising: int = 1
    """How many forward-backwards of the step reduce, each timed as ``sync``: all of them with
    ``no_sync=False`` (the later ones' adds into the reduced gradient left out)."""

    @property
    def step_ms(self) -> float:
        """The whole step: every forward-backward of the accumulation window."""
        first = 0.0 if self.no_sync is None else self.no_sync.iteration_ms
        again = 0.0 if self.no_sync_again is None else self.no_sync_again.iteration_ms
        return first + max(0, self.accumulate - 2) * again + self.synchronising * self.sync.iteration_ms


def predict_time(
    prediction: Prediction, *, flops_per_second: float, cost: CostModel = CostModel(), ranks_per_node: int = 8
) -> StepTime:
    """The step time of ``prediction``'s model as ``fsdp_core.sim.simulate_iteration`` models it:
    its units' plans and all-gather schedule, compute from the traced FLOPs at
    ``flops_per_second``, collectives priced by ``cost`` on links from ``ranks_per_node``. The
    optimizer step is not in it. A model, not a measurement: the sustained rate and the links are
    assumptions to name."""
    root = len(prediction.units) - 1
    accumulate = prediction.accumulate

    def iteration(sync: bool, follows_no_sync: bool) -> IterationTimeline:
        return simulate_iteration(
            model_of_units(
                prediction.units,
                prediction.trace,
                root=root,
                compute_ms=flops_compute_ms(prediction.trace, len(prediction.units), root, flops_per_second),
                cost=cost,
                ranks_per_node=ranks_per_node,
                backward_prefetch=prediction.options.backward_prefetch,
                forward_prefetch=prediction.options.forward_prefetch,
                sync=sync,
                follows_no_sync=follows_no_sync,
                fully_shard=prediction.fully_shard,
            )
        )

    if not prediction.no_sync:  # every forward-backward reduces
        return StepTime(
            no_sync=None,
            no_sync_again=None,
            sync=iteration(True, False),
            accumulate=accumulate,
            flops_per_second=flops_per_second,
            cost=cost,
            synchronising=accumulate,
        )
    return StepTime(
        no_sync=iteration(False, False) if accumulate > 1 else None,
        no_sync_again=iteration(False, True) if accumulate > 2 else None,
        sync=iteration(True, accumulate > 1),
        accumulate=accumulate,
        flops_per_second=flops_per_second,
        cost=cost,
    )


def _predict_fully_shard(
    module: nn.Module,
    step: StepFn,
    options: Options,
    *,
    kind: OptimizerKind,
    world_size: int,
    shard_size: int | None,
    reshard_after_forward: bool | int | None,
    explicit_prefetch: bool,
    accumulate: int,
    no_sync: bool,
    backend: str,
    workspace: int | None,
    refused: dict[str, bool],
) -> Prediction:
    """``predict_memory`` of ``api="fully_shard"`` (its docstring)."""
    for name, given in refused.items():
        if given:
            raise ValueError(f"{name}: fully_shard has no such option; leave it at its default with api='fully_shard'")
    strategy = options.strategy
    if not strategy.is_sharded:
        raise ValueError("sharding_strategy: NO_SHARD has no fully_shard form; use FULL_SHARD or HYBRID_SHARD")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise TypeError(f"reshard_after_forward: expected None, a bool or an int, got {reshard_after_forward!r}")
    sharding = ShardingSpec.for_world(strategy, world_size, shard_size)
    world = sharding.shard_size
    value: bool | int | None = reshard_after_forward
    if value is None and not strategy.reshards_after_forward:
        value = False
    post_forward = 0
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1 or world % value:
            raise ValueError(
                f"reshard_after_forward: expected a bool or a factor of the shard group's size ({world}), got {value}"
            )
        value = {1: False, world: True}.get(value, value)
        post_forward = 0 if isinstance(value, bool) else value
    gloo = backend == "gloo"
    allocator: Allocator = EXACT if gloo else CUDA_CACHING
    if workspace is None:
        workspace = 0 if gloo else cuda_workspaces(_capability(), os.environ).bytes
    mp = MixedPrecisionPolicy(
        param_dtype=options.mixed_precision.param_dtype, reduce_dtype=options.mixed_precision.reduce_dtype
    )
    settings = Settings(reshard_after_forward=value)
    caps = BackendCaps.for_backend(backend)
    replicate = sharding.replicate_size if strategy.is_hybrid else None

    sites = find_units(module, options.wrap, lambda m: False)
    position = {id(m): i for i, m in enumerate(module.modules())}
    blocks = sorted((site.module for site in sites[:-1]), key=lambda m: position[id(m)])
    done: set[int] = set()
    units: list[UnitSpec | None] = []
    trace_units: list[PerParamTraceUnit] = []
    where: dict[int, tuple[int, int]] = {}
    path_of = {id(m): name for name, m in module.named_modules()}
    for index, m in enumerate([*blocks, module]):
        params, slots, names = managed_params((m,), set(), lambda x: id(x) in done)
        done.add(id(m))
        for i, p in enumerate(params):
            where[id(p)] = (index, i)
        if not params:
            units.append(None)
            trace_units.append(PerParamTraceUnit(m, [], [], [], torch.float32))
            continue
        if len({p.dtype for p in params}) != 1:
            raise ValueError(f"module: the parameters under {path_of[id(m)] or 'the root'} must share one dtype")
        layout = per_param_layout(params, names, world)
        trainable = [p.requires_grad for p in params]
        if not any(trainable):
            raise ValueError(
                f"module: every parameter under {path_of[id(m)] or 'the root'} is frozen; the prediction of "
                "api='fully_shard' needs units that take gradients"
            )
        reduce_layout = PerParamLayout(
            params=tuple(spec for spec, t in zip(layout.params, trainable) if t), dtype=layout.dtype, world=world
        )
        request = per_param_request(
            reduce_layout,
            replicate_size=replicate,
            rank=0,
            mp=mp,
            offload=options.offload.offload_params,
            caps=caps,
            settings=settings,
            roles=frozenset(),
            all_reduce_hook=False,
        )
        frozen = frozenset(i for i, t in enumerate(trainable) if not t)
        units.append(
            UnitSpec(
                request=request,
                name=path_of[id(m)],
                frozen=frozen,
                gathered=layout,
                post_forward_ranks=post_forward if m is not module else 0,
            )
        )
        trace_units.append(
            PerParamTraceUnit(
                m,
                [list(s) for s in slots],
                [spec.shape for spec in layout.params],
                trainable,
                request.compute_dtype,
                restores=request.restores_pending,
            )
        )
    root = len(units) - 1
    owning = [i for i, u in enumerate(units[:root]) if u is not None]
    forward: list[tuple[int, ...]] = [()] * len(units)
    backward: list[tuple[int, ...]] = [()] * len(units)
    if explicit_prefetch:  # each block prefetches the next one in forward, the one before in backward
        for a, b in itertools.pairwise(owning):
            forward[a], backward[b] = (b,), (a,)
    gathers = PerUnitGathers(
        forward_reshards=tuple(reshards_after_forward(value, index == root) for index in range(len(units))),
        forward_prefetches=tuple(forward) if any(forward) else (),
        backward_prefetches=tuple(backward) if any(backward) else (),
    )
    trace = record_trace_per_param(module, trace_units, step, param_dtype=mp.param_dtype, block=allocator.block)
    accumulating = None
    if accumulate > 1 and no_sync and any(t.restores for t in trace_units):  # kept no_sync gradients in .grad
        accumulating = record_trace_per_param(
            module, trace_units, step, param_dtype=mp.param_dtype, accumulating=True, block=allocator.block
        )
    order = tuple(where[id(p)] for p in module.parameters() if id(p) in where)
    spec = OptimizerSpec(kind=kind, foreach=not gloo)
    ranks = _every_rank(
        ModelMemoryRequest(
            units=tuple(units),
            root=root,
            trace=trace,
            optimizer=spec,
            optimizer_order=order,
            accumulate=accumulate,
            no_sync=no_sync,
            backward_prefetch=None,
            executor=Executor.CPU_LANE if gloo else Executor.STREAMS,
            allocator=allocator,
            buffers=_buffer_bytes(module, None, allocator),
            workspace=workspace,
            fully_shard=gathers,
            accumulating_trace=accumulating,
        ),
        sharding.num_shards,
    )
    return Prediction(
        units=tuple(units),
        paths=tuple(path_of[id(m)] for m in [*blocks, module]),
        trace=trace,
        ranks=ranks,
        options=options,
        world_size=world_size,
        backend=backend,
        optimizer=spec,
        accumulate=accumulate,
        no_sync=no_sync,
        api="fully_shard",
        fully_shard=gathers,
    )
