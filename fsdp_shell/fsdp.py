"""``FullyShardedDataParallel``: FSDP1's wrapper, with the post-backward run from verified plans.

Each unit flattens the parameters its module owns (not those of nested units) into one
``FlatParamHandle``. Every hook runs the tree's all-gather schedule for its event
(``fsdp_shell.units.unshard``): forward gathers (and prefetches), runs the module on views of the
unsharded flat parameter and reshards for ``FULL_SHARD``/``HYBRID_SHARD``; a hook on the
forward's outputs gathers before the unit's backward. A post-accumulate-grad hook on the flat
parameter asks the tree's verifying plan cache for the plan of this unit's request and step
flags (from its carried gradient state) and runs its hook part; a callback queued on the
autograd engine runs the deferred part of every plan, waits for the side streams (on CPU: the
lane) and reshards what is left. Construction is in ``fsdp_shell.tree``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_core import (
    BackwardPrefetch,
    DivisionPolicy,
    Event,
    FlatParamLayout,
    HookEvent,
    HybridAllReduce,
    PlanRequest,
    ShardingSpec,
    ShardingStrategy,
    Stream,
    step_flags,
)
from fsdp_shell.safety.agreement import (
    CollectiveTimeoutError,
    RankMismatchError,
    check_agreement,
    check_same_events,
    gave_up_waiting,
)
from fsdp_shell.runtime.log import CollectiveRecord, Phase
from fsdp_shell.comm_hooks import builtin_kind
from fsdp_shell.units.flat_param import FlatParamHandle, OrigParam
from fsdp_shell.runtime.interpreter import PlanRun
from fsdp_shell.state.optim_state import optim_state_dict as optim_state_dict_of
from fsdp_shell.state.optim_state import optim_state_dict_to_load
from fsdp_shell.runtime.cpu import CudaRuntime
from fsdp_shell.safety.sequencer import Sequencer
from fsdp_shell.state.state_dict import (
    StateDictSettings,
    StateDictType,
    full_state_dict,
    load_state_dict,
    sharded_state_dict,
    state_dict_settings,
)
from fsdp_shell.tree import Tree, WrapPolicy, make_tree, parse_options
from fsdp_shell.units.unshard import UnshardRunner

__all__ = ["FSDP", "FullyShardedDataParallel"]


def _cast_floating(x: object, dtype: torch.dtype) -> object:
    """FSDP1's root input cast: floating-point tensors to the compute dtype."""
    if isinstance(x, torch.Tensor) and torch.is_floating_point(x):
        return x.to(dtype)
    return x


class FullyShardedDataParallel(nn.Module):
    """A drop-in for ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1).

    Arguments, with FSDP1's meaning:

    - ``module``: the model (or submodule) to shard.
    - ``process_group``: FSDP's group (default: the world), or ``(shard_group, replicate_group)``
      for hybrid strategies.
    - ``sharding_strategy``: a ``ShardingStrategy`` (ours or torch's, mapped by name).
    - ``cpu_offload``: ``CPUOffload(offload_params=True)`` keeps the sharded parameter and its
      gradient on the CPU, where the optimizer steps; works with gloo on CPU too.
    - ``auto_wrap_policy``: a set of ``nn.Module`` classes, a ``callable(module) -> bool``, or
      torch's ``ModuleWrapPolicy``; each matching submodule becomes a unit of its own.
    - ``mixed_precision``: compute in ``param_dtype``; reduce in ``reduce_dtype`` (or
      ``param_dtype``); the optimizer gets gradients in the original dtype unless
      ``keep_low_precision_grads``. Floating-point inputs of the root are cast to ``param_dtype``.
    - ``device_id``: ``torch.device`` or CUDA index; default: the current CUDA device with NCCL,
      else the CPU.
    - ``use_orig_params``: ``parameters()`` yields the original parameters, as sharded 1-D views
      (original shapes for ``NO_SHARD``; empty where this rank holds none), with sharded
      ``.grad`` views.
    - ``backward_prefetch`` (keyword only): ``BACKWARD_PRE`` (default), ``BACKWARD_POST`` or
      None, ours or torch's ``BackwardPrefetch``: when the next unit's all-gather is issued in
      backward (before this unit's gradient computation, after it, or on demand).
    - ``forward_prefetch`` (keyword only): issue the next unit's all-gather before this unit's
      forward runs. Both follow the execution order recorded in the first iteration, which
      gathers on demand; at most one all-gather runs ahead of use.
    - ``device_mesh``: a 1-D (shard) or 2-D (replicate, shard) ``DeviceMesh`` instead of
      ``process_group``.
    - ``hybrid_all_reduce`` (keyword only; ours): ``"async"`` (default) runs the hybrid replicate
      all-reduce on its own stream, overlapping the next reduce-scatters and all-gathers (PyTorch
      PR 106080); ``"sync"`` runs it after each reduce-scatter on the post-backward stream, as
      FSDP1 did before, for comparison. Hybrid strategies only.
    - ``ranks_may_diverge`` (keyword only; ours): True when ranks' models may take different
      paths (a wrapped module skipped or its output unused on some ranks only): before every
      FSDP event the ranks agree on it (one tiny collective each) and a rank runs the events it
      would skip with nothing to contribute (a zero gradient), so nothing hangs and the result
      is the reference's. False (default): no per-event cost; at the end of each backward the
      ranks compare the events they ran (one tiny collective) and raise ``RankMismatchError``
      if they differ.
    - ``division_policy`` (keyword only; ours): where the average's division goes.
      ``"pre_post"`` (default, FSDP1): divide by a power of two near sqrt(N) before the
      reduction and by the rest after. ``"in_collective"`` (FSDP2): let the collective average
      (``ReduceOp.AVG``, or ``PREMUL_SUM`` for a custom factor) where the backend can (NCCL) for
      fp32/bf16, split the division for fp16, and divide once after the reduction otherwise
      (gloo).

    Bad configuration raises ``ValueError``/``TypeError`` here, naming the argument.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: object = None,
        sharding_strategy: object = ShardingStrategy.FULL_SHARD,
        cpu_offload: object = None,
        auto_wrap_policy: object = None,
        mixed_precision: object = None,
        device_id: object = None,
        use_orig_params: bool = False,
        device_mesh: object = None,
        *,
        backward_prefetch: object = BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch: bool = False,
        division_policy: object = DivisionPolicy.PRE_POST,
        hybrid_all_reduce: object = HybridAllReduce.ASYNC,
        ranks_may_diverge: bool = False,
        _tree: Tree | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError("module: already wrapped in FullyShardedDataParallel")
        self._is_root = _tree is None
        if _tree is None:
            options = parse_options(
                sharding_strategy=sharding_strategy, cpu_offload=cpu_offload, auto_wrap_policy=auto_wrap_policy,
                mixed_precision=mixed_precision, use_orig_params=use_orig_params,
                backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
                division_policy=division_policy, hybrid_all_reduce=hybrid_all_reduce,
                ranks_may_diverge=ranks_may_diverge,
            )
            _tree = make_tree(module, options, process_group=process_group, device_mesh=device_mesh,
                              device_id=device_id)
            if options.wrap is not None:
                self._wrap_children(module, options.wrap, _tree)
        self._tree = _tree
        self.module = module
        self._pre_backward_ran = False
        self._handle = self._make_handle(module, _tree)
        self._index = len(_tree.units)
        _tree.units.append(self)
        if self._handle is not None and not _tree.use_orig_params:
            self.register_parameter("_flat_param", self._handle.flat_param)
        if self._is_root:
            _tree.sequencer = _sequencer(_tree, self._index)
            _tree.unshard = UnshardRunner(
                [u._handle for u in _tree.units], self._index,
                reshard_after_forward=_tree.strategy.reshards_after_forward,
                reshard_after_backward=_tree.strategy.is_sharded,
                backward_prefetch=_tree.backward_prefetch, forward_prefetch=_tree.forward_prefetch,
            )

    # -- construction --------------------------------------------------------------------------

    @staticmethod
    def _wrap_children(module: nn.Module, policy: WrapPolicy, tree: Tree) -> None:
        for name, child in list(module.named_children()):
            if isinstance(child, FullyShardedDataParallel):
                continue
            FullyShardedDataParallel._wrap_children(child, policy, tree)
            if policy(child) and any(True for _ in child.parameters()):
                setattr(module, name, FullyShardedDataParallel(child, _tree=tree))

    @staticmethod
    def _owned_params(module: nn.Module, tree: Tree) -> list[tuple[OrigParam, nn.Parameter]]:
        """The parameters ``module`` owns outside nested units, with their unwrapped names, each
        once (a tied parameter with its further registrations as aliases). A parameter a nested
        unit has already flattened is refused: FSDP1 too needs every use of a shared parameter
        inside the unit that flattens it."""
        names = tree.param_names
        slots: dict[int, list[tuple[nn.Module, str]]] = {}
        tensors: dict[int, nn.Parameter] = {}

        def visit(m: nn.Module) -> None:
            for attr, p in m._parameters.items():
                if p is None:
                    continue
                owner = tree.owners.get(id(p))
                if owner is not None:
                    prefix = names[id(p)].rpartition(".")[0]
                    raise ValueError(
                        f"module: parameter {names[id(p)]} is shared across FSDP units: the unit of "
                        f"{owner!r} flattened it and {type(m).__name__}.{attr} of another unit uses it too; "
                        f"a shared parameter must be used inside one unit, so wrap both uses in one (their "
                        f"lowest common ancestor), e.g. keep {prefix or 'its module'} out of auto_wrap_policy")
                slots.setdefault(id(p), []).append((m, attr))
                tensors[id(p)] = p
            for child in m.children():
                if not isinstance(child, FullyShardedDataParallel):
                    visit(child)

        visit(module)
        out: list[tuple[OrigParam, nn.Parameter]] = []
        for key, ((m, attr), *aliases) in slots.items():
            out.append((OrigParam(module=m, attr=attr, fqn=names[key], aliases=tuple(aliases)), tensors[key]))
        label = type(module).__name__ + (f" holding {out[0][0].fqn}" if out else "")
        for key in slots:
            tree.owners[key] = label
        return out

    def _make_handle(self, module: nn.Module, tree: Tree) -> FlatParamHandle | None:
        owned = self._owned_params(module, tree)
        if not owned:
            return None
        params, tensors = [o for o, _ in owned], [t for _, t in owned]
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise ValueError(f"module: one FSDP unit needs one parameter dtype, got {sorted(map(str, dtypes))}")
        if len({t.requires_grad for t in tensors}) != 1 and not tree.use_orig_params:
            frozen = [p.fqn for p, t in owned if not t.requires_grad]
            raise ValueError(f"module: frozen parameters ({', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''}) "
                             "beside trainable ones in one FSDP unit need use_orig_params=True (as in FSDP1), "
                             "or wrap the frozen ones in a unit of their own")
        (dtype,) = dtypes
        compute = tree.mixed_precision.compute_dtype(dtype)
        layout = FlatParamLayout.of([(p.fqn, tuple(t.shape)) for p, t in owned], dtype,
                                    align=tree.use_orig_params, align_dtype=compute)
        sharding = ShardingSpec(strategy=tree.strategy, shard_size=tree.groups.shard_size,
                                replicate_size=tree.groups.replicate_size, rank=tree.groups.shard.rank())
        request = PlanRequest(layout=layout, sharding=sharding, mixed_precision=tree.mixed_precision,
                              offload=tree.offload, comm_hook=tree.comm_hook_kind, division=tree.division,
                              use_orig_params=tree.use_orig_params, hybrid_all_reduce=tree.hybrid_all_reduce)
        runtime = tree.ctx.runtime
        gather_stream = runtime.streams[Stream.ALL_GATHER] if isinstance(runtime, CudaRuntime) else None
        handle = FlatParamHandle(params, tensors, base_request=request, shard_group=tree.groups.shard,
                                 gather_group=tree.groups.gather_group, device=tree.device, log=tree.ctx.log,
                                 gather_stream=gather_stream)
        if handle.flat_param.requires_grad:
            handle.flat_param.register_post_accumulate_grad_hook(self._post_backward)  # type: ignore[no-untyped-call]  # unannotated in torch
        return handle

    # -- public API ----------------------------------------------------------------------------

    @property
    def process_group(self) -> dist.ProcessGroup:
        """FSDP's process group (the shard group for hybrid strategies)."""
        return self._tree.groups.shard

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """The replicate group of hybrid strategies."""
        return self._tree.groups.replicate

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The strategy every unit of this tree uses."""
        return self._tree.strategy

    def _flat_handles(self) -> list[FlatParamHandle]:
        """The flat parameter of every unit of this tree, in construction order (children first)."""
        self._require_root("_flat_handles")
        return [u._handle for u in self._tree.units if u._handle is not None]

    def collective_log(self) -> list[CollectiveRecord]:
        """Every collective the runtime has issued so far (all-gathers, reductions), in issue
        order within each group: ``(op, group, dtype, numel, phase)``."""
        return list(self._tree.ctx.log.records)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate the unsharded gradient locally; nothing is communicated."""
        self._require_root("no_sync")
        previous = self._tree.sync_gradients
        self._tree.sync_gradients = False
        try:
            yield
        finally:
            self._tree.sync_gradients = previous

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        """Hybrid only: False defers the replicate all-reduce, keeping a partial reduction that
        the next backward with True folds in (FSDP2's gradient-accumulation saving)."""
        self._require_root("set_requires_all_reduce")
        if not isinstance(requires_all_reduce, bool):
            raise TypeError(f"requires_all_reduce: expected a bool, got {requires_all_reduce!r}")
        if not requires_all_reduce and not self._tree.strategy.is_hybrid:
            raise ValueError(f"requires_all_reduce: only hybrid strategies can defer the all-reduce, not {self._tree.strategy.name}")
        self._tree.requires_all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        """FSDP2's ``set_gradient_divide_factor``: divide the summed gradient by ``factor``
        instead of the data-parallel size (None restores the average). Not with a comm hook,
        whose state divides."""
        self._require_root("set_gradient_divide_factor")
        tree = self._tree
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))):
            raise TypeError(f"factor: expected a positive number or None, got {factor!r}")
        division = dataclasses.replace(tree.division, factor=None if factor is None else float(factor))
        self._replan(division=division)
        tree.division = division

    def _replan(self, **changes: Any) -> None:
        """Apply ``changes`` to every unit's plan request; a combination the core rejects raises
        here, before any unit has changed."""
        handles = [u._handle for u in self._tree.units if u._handle is not None]
        requests = [dataclasses.replace(h.request, **changes) for h in handles]
        for h, request in zip(handles, requests):
            h.request = request

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Replace the shard-group collective by ``hook(state, grad, output=None)`` (FSDP1's signature)."""
        self._require_root("register_comm_hook")
        if not callable(hook):
            raise TypeError(f"hook: expected a callable, got {hook!r}")
        if self._tree.comm_hook is not None:
            raise ValueError("hook: a communication hook is already registered; FSDP takes one")
        if self._tree.agreement_seconds is not None:
            raise ValueError("hook: register the communication hook before the first forward (as in FSDP1)")
        _check_hook_signature(hook, state, self._tree.strategy)
        kind = builtin_kind(hook)
        self._replan(comm_hook=kind)

        def bound(grad: torch.Tensor, output: torch.Tensor | None) -> None:
            if output is None:
                hook(state, grad)
            else:
                hook(state, grad, output)

        self._tree.comm_hook = bound
        self._tree.comm_hook_kind = kind

    def full_state_dict(self) -> dict[str, Any]:
        """Full, unsharded values under the unwrapped module's ``state_dict()`` keys (every name
        of a tied parameter, persistent buffers, ``_extra_state``), on every rank."""
        self._require_root("full_state_dict")
        return full_state_dict(self._tree, StateDictSettings(), self._tree.groups.shard.rank())

    def load_full_state_dict(self, state_dict: Mapping[str, object], strict: bool = True) -> _IncompatibleKeys:
        """Load what ``full_state_dict()`` (or the unwrapped module's ``state_dict()``) returns;
        ``strict`` and the result as ``nn.Module.load_state_dict``."""
        self._require_root("load_full_state_dict")
        return load_state_dict(self._tree, state_dict, strict=_strict(strict))

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> Any:
        """FSDP1's default: the full state dict under the unwrapped module's keys; inside
        ``FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)``, DTensor shards for
        ``torch.distributed.checkpoint``. A collective: every rank calls it. (A nested unit,
        reached by ``nn.Module``'s recursion from below the root, gives ``nn.Module``'s own.)"""
        if not self._is_root:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if args:
            raise TypeError("state_dict: pass destination, prefix and keep_vars by keyword")
        tree = self._tree
        settings = tree.state_dict_settings
        if settings.kind is StateDictType.SHARDED_STATE_DICT:
            values = sharded_state_dict(tree, settings, tree.mesh())
        else:
            values = full_state_dict(tree, settings, tree.groups.shard.rank())
        out: Any = {} if destination is None else destination
        for key, value in values.items():
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """The inverse of ``state_dict()``: full tensors or DTensors under the unwrapped
        module's keys, copied into this rank's shards."""
        if not self._is_root:
            own: _IncompatibleKeys = super().load_state_dict(state_dict, strict=strict, assign=assign)
            return own
        if assign:
            raise ValueError("load_state_dict: assign=True would replace the sharded parameters; use assign=False")
        return load_state_dict(self._tree, state_dict, strict=_strict(strict))

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: object, state_dict_config: object = None,
                        optim_state_dict_config: object = None) -> Iterator[None]:
        """FSDP1's context manager: ``state_dict()`` / ``load_state_dict()`` of every FSDP root in
        ``module`` use ``state_dict_type`` (ours or torch's ``StateDictType``) inside."""
        previous = FullyShardedDataParallel.set_state_dict_type(module, state_dict_type, state_dict_config,
                                                                 optim_state_dict_config)
        try:
            yield
        finally:
            for root in _roots(module):
                root._tree.state_dict_settings = previous

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: object = None, group: object = None) -> dict[str, Any]:
        """FSDP1's ``FSDP.optim_state_dict``: ``optim``'s state under the original parameter
        names, full or (inside ``state_dict_type(..., SHARDED_STATE_DICT)``) as DTensors that
        ``torch.distributed.checkpoint`` saves. A collective."""
        root = _root_of(model)
        if optim_state_dict is not None or group is not None:
            raise ValueError("optim_state_dict, group: not supported; the optimizer's own state is read")
        tree = root._tree
        return optim_state_dict_of(tree, optim, tree.state_dict_settings, tree.mesh(), tree.groups.shard.rank())

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                                 optim_state_dict: Mapping[str, Any], is_named_optimizer: bool = False,
                                 load_directly: bool = False, group: object = None) -> dict[str, Any]:
        """FSDP1's inverse: what ``optim.load_state_dict`` takes on this rank (with
        ``load_directly``, loaded and returned). A collective."""
        if is_named_optimizer or group is not None:
            raise ValueError("is_named_optimizer, group: not supported")
        out = optim_state_dict_to_load(_root_of(model)._tree, optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(out)
        return out

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: object, state_dict_config: object = None,
                            optim_state_dict_config: object = None) -> StateDictSettings:
        """Set what ``state_dict()`` returns for every FSDP root in ``module``; returns the
        previous settings."""
        settings = state_dict_settings(state_dict_type, state_dict_config)
        if optim_state_dict_config is not None:
            state_dict_settings(state_dict_type, optim_state_dict_config)
        roots = _roots(module)
        if not roots:
            raise ValueError("module: contains no FullyShardedDataParallel root")
        previous = roots[0]._tree.state_dict_settings
        for root in roots:
            root._tree.state_dict_settings = settings
        return previous

    def clip_grad_norm_(self, max_norm: float, norm_type: float | str = 2.0) -> torch.Tensor:
        """Clip all gradients by their total norm across all shards; returns that norm."""
        self._require_root("clip_grad_norm_")
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not math.isfinite(max_norm) \
                or max_norm < 0:
            raise ValueError(f"max_norm: expected a finite number >= 0, got {max_norm!r}")
        if norm_type == "inf":
            norm_type = float("inf")
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
            raise TypeError(f"norm_type: expected a number > 0 or inf, got {norm_type!r}")
        if math.isnan(norm_type) or norm_type <= 0:
            raise ValueError(f"norm_type: expected a number > 0 or inf, got {norm_type!r}")
        p = float(norm_type)
        device = self._tree.device
        sharded, replicated = torch.zeros((), device=device), torch.zeros((), device=device)
        grads: list[torch.Tensor] = []
        for unit in self._tree.units:
            h = unit._handle
            if h is None:
                continue
            unit_grads = h.optimizer_grads()
            if not unit_grads:
                continue
            grads.extend(unit_grads)
            norms = torch.stack([torch.linalg.vector_norm(g.detach().float(), p) for g in unit_grads])
            local = torch.linalg.vector_norm(norms, p).to(device)
            if p == float("inf"):
                target = sharded if h.is_sharded else replicated
                target.copy_(torch.maximum(target, local))
            elif h.is_sharded:
                sharded += local**p
            else:
                replicated += local**p
        if p == float("inf"):
            dist.all_reduce(sharded, op=dist.ReduceOp.MAX, group=self._tree.groups.shard)
            total = torch.maximum(sharded, replicated)
        else:
            dist.all_reduce(sharded, group=self._tree.groups.shard)
            total = (sharded + replicated) ** (1.0 / p)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for g in grads:
                g.mul_(coef.to(g.device, g.dtype))
        return total

    # -- forward and backward -------------------------------------------------------------------

    def _require_root(self, what: str) -> None:
        if not self._is_root:
            raise RuntimeError(f"{what}: call it on the root FullyShardedDataParallel module")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """All-gather this unit's parameters, run the wrapped module on autograd views of them,
        reshard (``FULL_SHARD``/``HYBRID_SHARD``, non-root) and hook the outputs so backward
        re-gathers first."""
        tree, h = self._tree, self._handle
        grad_on = torch.is_grad_enabled()
        with self._waiting("forward"):
            if self._is_root:
                if tree.agreement_seconds is None:
                    tree.agreement_seconds = check_agreement(tree)
                if tree.backward_started or tree.runs:
                    self._reset_backward()
                tree.ctx.runtime.drain()
                tree.ctx.log.phase = Phase.FORWARD
                for unit in tree.units:
                    if unit._handle is not None:
                        unit._handle.release_if_zeroed()
                if grad_on:
                    tree.gathers().begin_forward()
                low = tree.mixed_precision.param_dtype
                if low is not None:
                    args, kwargs = tree_map(lambda x: _cast_floating(x, low), (args, kwargs))
            if h is not None:
                if not self._is_root:
                    self._sequence(HookEvent(Event.PRE_FORWARD, self._index), grad_on)
                if grad_on:
                    tree.gathers().run(Event.PRE_FORWARD, self._index)
                h.finish_unshard()
                h.use_unsharded_views()
        try:
            out = self.module(*args, **kwargs)
            if self._is_root:
                with self._waiting("end of forward"):
                    self._sequence(HookEvent(Event.END_FORWARD, -1), grad_on)
        finally:
            if h is not None:
                h.restore_params()
            if self._is_root:
                tree.ctx.log.phase = Phase.OTHER
        if h is not None:
            with self._waiting("forward"):
                if grad_on:
                    tree.gathers().run(Event.POST_FORWARD, self._index)
                else:
                    h.free_unsharded()
        if grad_on:
            self._register_pre_backward(out)
        return out

    def _reset_backward(self) -> None:
        """The previous backward did not finish (an exception in a hook, or in the user's code
        between backward's start and its end): drop its half-done work, as FSDP1's root
        forward does, so this step starts clean. Gradients it had not finished are lost, as they
        are in FSDP1; those handed to the optimizer before stay."""
        tree = self._tree
        tree.runs = []
        tree.events = []
        tree.reduced_virtually.clear()
        try:
            tree.ctx.runtime.drain()
        except RuntimeError:
            pass
        self._settle_units(keep_unsharded=False, drop_partial=True)

    def _settle_units(self, *, keep_unsharded: bool, drop_partial: bool) -> None:
        """After a backward (or in place of one that did not finish): original parameters back,
        unsharded storage freed unless kept, the optimizer's gradient shown in ``.grad``; with
        ``drop_partial``, the gradient autograd was accumulating for a unit whose post-backward
        never ran is dropped first."""
        tree = self._tree
        for unit in tree.units:
            h = unit._handle
            if h is not None:
                h.restore_params()
                if drop_partial and unit._pre_backward_ran:
                    h.flat_param.grad = None
                if not keep_unsharded:
                    h.free_unsharded()
                h.expose()
            unit._pre_backward_ran = False
        tree.backward_started = False
        tree.ctx.log.phase = Phase.OTHER

    def _register_pre_backward(self, out: object) -> None:
        for t in _tensors_in(out):
            if t.requires_grad:
                t.register_hook(self._pre_backward)  # type: ignore[no-untyped-call]  # unannotated in torch

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        tree = self._tree
        if not tree.backward_started:
            tree.backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._tree_final_callback)
        if not self._pre_backward_ran and self._handle is not None:
            with self._waiting("backward"):
                self._sequence(HookEvent(Event.PRE_BACKWARD, self._index), True)
                self._unshard_for_backward()
        return grad

    def _unshard_for_backward(self) -> None:
        tree, h = self._tree, self._handle
        assert h is not None
        self._pre_backward_ran = True
        tree.ctx.log.phase = Phase.PRE_BACKWARD
        h.begin_backward()
        tree.gathers().run(Event.PRE_BACKWARD, self._index)
        h.finish_unshard()
        if tree.use_orig_params:
            h.use_unsharded_views()

    def _sequence(self, event: HookEvent, grad_on: bool) -> None:
        """With ``ranks_may_diverge``: agree with the other ranks that ``event`` is next here,
        running first (virtually) every earlier event another rank is at
        (``fsdp_shell.safety.sequencer``). Without: record it, and at the end of backward check that
        every rank ran the same events."""
        tree = self._tree
        if tree.sequencer is None:
            if grad_on:
                tree.events.append(event)
            if event.event is Event.END_BACKWARD:
                events, tree.events = tree.events, []
                check_same_events(tree, events)
            return
        while (decided := tree.sequencer.agree(event)) != event:
            tree.units[decided.unit]._run_virtually(decided.event, grad_on)

    def _run_virtually(self, kind: Event, grad_on: bool) -> None:
        """This unit's event, which other ranks run and this one would skip: the same
        collectives, with nothing computed (a zero gradient for the reduction)."""
        tree, h = self._tree, self._handle
        assert h is not None
        if kind is Event.PRE_FORWARD:
            if grad_on:
                tree.gathers().run(Event.PRE_FORWARD, self._index)
            h.finish_unshard()
            if grad_on:
                tree.gathers().run(Event.POST_FORWARD, self._index)
            else:
                h.free_unsharded()
        elif kind is Event.PRE_BACKWARD:
            if not self._pre_backward_ran:
                self._unshard_for_backward()
        elif kind is Event.POST_BACKWARD:
            if not self._pre_backward_ran:
                self._unshard_for_backward()
            h.restore_params()
            tree.reduced_virtually.add(self._index)
            self._reduce(torch.zeros(h.layout.total_numel, dtype=h.flat_param.dtype, device=h.flat_param.device))
        else:
            raise AssertionError(f"the ends of forward and backward are never run virtually: {kind}")

    def _post_backward(self, param: torch.Tensor) -> None:
        h, tree = self._handle, self._tree
        assert h is not None
        if self._index in tree.reduced_virtually:
            raise RankMismatchError(
                f"FSDP: unit {self._index}'s gradient arrived on rank {dist.get_rank()} after the ranks had "
                "reduced it with a zero gradient here: the ranks' backward orders differ, not only which "
                "units they use")
        with self._waiting("gradient reduction"):
            self._sequence(HookEvent(Event.POST_BACKWARD, self._index), True)
            h.restore_params()
            self._reduce(h.take_grad())

    def _reduce(self, grad: torch.Tensor) -> None:
        """Run this unit's post-backward plan on ``grad`` (its unsharded gradient)."""
        h, tree = self._handle, self._tree
        assert h is not None
        sync = tree.sync_gradients
        flags = step_flags(h.carried.roles, sync_gradients=sync,
                           requires_all_reduce=tree.requires_all_reduce or not sync)
        plan = tree.plans(dataclasses.replace(h.request, flags=flags))
        run = PlanRun(plan, tree.ctx, h, grad, h.carried, tree.comm_hook)
        tree.ctx.log.phase = Phase.POST_BACKWARD
        run.hook_phase()
        tree.runs.append(run)
        tree.gathers().run(Event.POST_BACKWARD, self._index)

    def _tree_final_callback(self) -> None:
        tree = self._tree
        with self._waiting("end of backward"):
            self._sequence(HookEvent(Event.END_BACKWARD, -1), True)
            tree.reduced_virtually.clear()
            tree.ctx.log.phase = Phase.END_OF_BACKWARD
            runs, tree.runs = tree.runs, []
            try:
                for run in runs:
                    run.callback_phase()
                tree.ctx.runtime.drain()
            finally:
                keep = not tree.sync_gradients and not tree.strategy.reshards_after_forward
                self._settle_units(keep_unsharded=keep, drop_partial=False)
            tree.gathers().end_backward()

    @contextlib.contextmanager
    def _waiting(self, step: str) -> Iterator[None]:
        """FSDP's own collectives of ``step``: a backend that gives up waiting for the other ranks
        (the process group's timeout, a peer gone) becomes a ``CollectiveTimeoutError`` saying
        where this rank was and what usually causes it."""
        try:
            yield
        except RuntimeError as error:
            if not gave_up_waiting(error):
                raise
            h = self._handle
            unit = "the root" if self._is_root else f"unit {self._index}"
            if h is not None and h.layout.params:
                unit += f" (holding {h.layout.params[0].name})"
            mode = ("even with ranks_may_diverge=True: a rank stopped, died or is still busy"
                    if self._tree.sequencer is not None else
                    "a rank stopped, died or is still busy, or the ranks' models took different paths (a wrapped "
                    "module skipped, or its output left unused, on some ranks only: pass ranks_may_diverge=True "
                    "for models that do that)")
            raise CollectiveTimeoutError(
                f"FSDP: rank {dist.get_rank()} gave up waiting for the other ranks in the {step} of {unit}: {mode}. "
                f"Backend: {_first_line(error)}") from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _sequencer(tree: Tree, root: int) -> Sequencer | None:
    """The event sequencer over the tree's control group (none when turned off)."""
    if not tree.sequence_events:
        return None
    return Sequencer(tree.control(), root)


def _tensors_in(out: object) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output, as FSDP1's ``_apply_to_tensors`` finds them: pytree
    containers (tuples, lists, dicts, namedtuples, Hugging Face ``ModelOutput``) and dataclasses."""
    seen: set[int] = set()
    stack = [out]
    while stack:
        leaves, _ = tree_flatten(stack.pop())
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                yield leaf
            elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and id(leaf) not in seen:
                seen.add(id(leaf))
                stack.extend(getattr(leaf, f.name) for f in dataclasses.fields(leaf))


def _check_hook_signature(hook: Callable[..., Any], state: object, strategy: ShardingStrategy) -> None:
    """The plan calls ``hook(state, grad, output)`` for sharded strategies (reduce into this
    rank's shard) and ``hook(state, grad)`` otherwise; a hook that cannot take that is refused
    now rather than half-way through a backward."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return
    args: tuple[object, ...] = (state, None, None) if strategy.is_sharded else (state, None)
    try:
        signature.bind(*args)
    except TypeError:
        wanted = "hook(state, grad, output)" if strategy.is_sharded else "hook(state, grad)"
        name = getattr(hook, "__name__", repr(hook))
        advice = (" (torch's allreduce_hook is for NO_SHARD; use reduce_scatter_hook)"
                  if strategy.is_sharded and name == "allreduce_hook" else "")
        raise TypeError(f"hook: {strategy.name} calls {wanted}, which {name}{signature} cannot take{advice}") from None


def _root_of(model: nn.Module) -> FullyShardedDataParallel:
    roots = _roots(model)
    if len(roots) != 1:
        raise ValueError(f"model: expected one FullyShardedDataParallel root, found {len(roots)}")
    return roots[0]


def _roots(module: nn.Module) -> list[FullyShardedDataParallel]:
    return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel) and m._is_root]


def _strict(strict: object) -> bool:
    if not isinstance(strict, bool):
        raise TypeError(f"strict: expected a bool, got {strict!r}")
    return strict


FSDP = FullyShardedDataParallel
