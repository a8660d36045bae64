"""``FullyShardedDataParallel``: FSDP1's ``nn.Module`` wrapper and its public API.

The constructor validates every argument (``fsdp_shell.options``), makes the tree (groups,
device, runtime, every unit's flat parameter: ``fsdp_shell.tree``), puts a nested wrapper where
each unit's module was and hooks the flat parameters. Everything that happens during an
iteration is in ``fsdp_shell.hooks``, as functions of ``(tree, unit)``; this class only holds
its unit's index and the tree, and answers FSDP1's API: ``no_sync``, comm hooks, state dicts,
optimizer state dicts, clipping.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._common_utils import TrainingState

from fsdp_core import (
    BackwardPrefetch,
    CPUOffload,
    DivisionPolicy,
    HybridAllReduce,
    MixedPrecision,
    ShardingStrategy,
)
from fsdp_shell import comm_hooks, hooks
from fsdp_shell.deprecated import DeprecatedOptimStateHelpers
from fsdp_shell.options import check_mixed_precision, flag, parse_options, to_ignored
from fsdp_shell.runtime.collectives import CollectiveKind, CollectiveRecord
from fsdp_shell.state import distributed as distributed_state_dict
from fsdp_shell.state.api import StateDictAPI, roots
from fsdp_shell.tree import Tree, make_tree
from fsdp_shell.units.flat_param import FlatParamHandle
from fsdp_shell.units.grad_norm import clip_grad_norm
from fsdp_shell.units.summon import summoned_trees

__all__ = ["FLAT_PARAM", "FSDP", "WRAPPED_MODULE", "FullyShardedDataParallel"]

WRAPPED_MODULE = "_fsdp_wrapped_module"
"""Where a wrapper registers the module it wraps (FSDP1's name)."""
FLAT_PARAM = "_flat_param"
"""Where the wrapped module holds its unit's flat parameter without ``use_orig_params`` (FSDP1's name)."""


class FullyShardedDataParallel(StateDictAPI, DeprecatedOptimStateHelpers, nn.Module):
    """A drop-in for ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1).

    Arguments, with FSDP1's meaning:

    - ``module``: the model (or submodule) to shard.
    - ``process_group``: FSDP's group (default: the world), or ``(shard_group, replicate_group)``
      for hybrid strategies.
    - ``sharding_strategy``: a ``ShardingStrategy`` (ours or torch's, mapped by name).
    - ``cpu_offload``: ``CPUOffload(offload_params=True)`` keeps the sharded parameter and its
      gradient on the CPU, where the optimizer steps; works with gloo on CPU too.
    - ``auto_wrap_policy``: a set of ``nn.Module`` classes, a ``callable(module) -> bool``,
      FSDP1's ``callable(module, recurse, nonwrapped_numel) -> bool`` (torch's
      ``transformer_auto_wrap_policy``, ``size_based_auto_wrap_policy``,
      ``lambda_auto_wrap_policy`` as ``functools.partial``), or torch's ``ModuleWrapPolicy`` or
      ``CustomPolicy``; the units are chosen as FSDP1 chooses them.
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
    - ``param_init_fn`` (keyword; FSDP1's): for a model built under ``torch.device("meta")``,
      called on every module breadth-first to give it real storage (for example
      ``m.to_empty(device=..., recurse=False)`` and an initialization). Without it a meta model
      is materialized as FSDP1 does: ``to_empty(recurse=False)`` and ``reset_parameters()`` for
      every module with meta states of its own.
    - ``sync_module_states`` (keyword; FSDP1's): broadcast rank 0's parameters and buffers to
      every rank before sharding (over the shard group, then the replicate group), so a model
      loaded on rank 0 alone starts the same everywhere.
    - ``ignored_modules`` / ``ignored_states`` (keyword; FSDP1's): modules (with their
      descendants), or parameters, that FSDP leaves alone: not flattened, sharded, reduced,
      materialized, moved, broadcast or cast; each rank keeps its own values and gradients, which
      ``parameters()``, the state dicts, the optimizer state dicts and ``clip_grad_norm_``
      include as they are.
    - ``limit_all_gathers`` (keyword; FSDP1's, default True): before issuing an all-gather the
      host waits until the device has freed all but one of the unsharded buffers it freed
      (``fsdp_shell.units.gather_limit``), so a host running ahead of an accelerator holds at
      most two units' gathered parameters; never waits on the CPU, where the host computes.

    Bad configuration raises ``ValueError``/``TypeError`` here, naming the argument.
    """

    _tree: Tree
    _index: int

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
        param_init_fn: Callable[[nn.Module], None] | None = None,
        sync_module_states: bool = False,
        limit_all_gathers: bool = True,
        ignored_modules: object = None,
        ignored_states: object = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError("module: already wrapped in FullyShardedDataParallel")
        options = parse_options(
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            auto_wrap_policy=auto_wrap_policy,
            mixed_precision=mixed_precision,
            use_orig_params=use_orig_params,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            division_policy=division_policy,
            hybrid_all_reduce=hybrid_all_reduce,
            ranks_may_diverge=ranks_may_diverge,
            param_init_fn=param_init_fn,
            sync_module_states=sync_module_states,
            limit_all_gathers=limit_all_gathers,
        )
        check_mixed_precision(module, mixed_precision, options)
        is_wrapped: Callable[[nn.Module], bool] = lambda m: isinstance(m, FullyShardedDataParallel)  # noqa: E731
        tree, sites = make_tree(
            module,
            options,
            process_group=process_group,
            device_mesh=device_mesh,
            device_id=device_id,
            is_wrapped=is_wrapped,
            ignored=to_ignored(module, ignored_modules, ignored_states, is_wrapped),
        )
        for index, site in enumerate(sites[:-1]):
            assert site.parent is not None
            setattr(site.parent, site.attr, FullyShardedDataParallel._unit(site.module, tree, index))
        self._attach(module, tree, tree.root)
        hooks.install(tree)
        distributed_state_dict.install(FullyShardedDataParallel)

    @classmethod
    def _unit(cls, module: nn.Module, tree: Tree, index: int) -> FullyShardedDataParallel:
        """The wrapper of a nested unit of ``tree``."""
        wrapper = cls.__new__(cls)
        nn.Module.__init__(wrapper)
        wrapper._attach(module, tree, index)
        return wrapper

    def _attach(self, module: nn.Module, tree: Tree, index: int) -> None:
        self._tree = tree
        self._index = index
        self._fsdp_wrapped_module = module
        h = tree.handles[index]
        if h is not None and not tree.options.use_orig_params:
            h.register_flat_param(module, FLAT_PARAM)

    @property
    def module(self) -> nn.Module:
        """The wrapped module (registered as ``_fsdp_wrapped_module``, FSDP1's name, so
        ``named_parameters()`` and ``named_modules()`` give FSDP1's names, which torch's
        ``clean_tensor_name`` turns into the unwrapped model's)."""
        wrapped: nn.Module = self._modules[WRAPPED_MODULE]  # type: ignore[assignment]  # registered in _attach
        return wrapped

    @property
    def _is_root(self) -> bool:
        return self._index == self._tree.root

    def _require_root(self, what: str) -> None:
        if not self._is_root:
            raise RuntimeError(f"{what}: call it on the root FullyShardedDataParallel module")

    def _require_state_root(self, what: str) -> None:
        if not self._is_root:
            prefix = self._tree.prefix(self._index)
            raise RuntimeError(
                f"{what}: this is a nested FSDP unit ({self._tree.where(self._index)}); call {what}() on the root "
                f"FullyShardedDataParallel module, where this unit's entries are the keys starting with {prefix!r}"
            )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """All-gather this unit's parameters, run the wrapped module on autograd views of them,
        reshard (``FULL_SHARD``/``HYBRID_SHARD``, non-root) and hook the outputs so backward
        re-gathers first (``fsdp_shell.hooks.forward``)."""
        return hooks.forward(self._tree, self._index, self.module, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        """FSDP1's fall-through: what the wrapper does not have is the wrapped module's
        (``model.config`` of a Hugging Face model, a submodule, a plain attribute)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("_modules", {}).get(WRAPPED_MODULE)
            if wrapped is None or name == WRAPPED_MODULE:
                raise
            return getattr(wrapped, name)

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """FSDP1's: ``fn`` on every submodule and this one, each unit with its full parameters
        (``summon_full_params(recurse=False)`` around it, writing back), so initializers such
        as ``nn.init.normal_(m.weight)`` work as on the unwrapped model. A collective."""
        with FullyShardedDataParallel.summon_full_params(self, recurse=False):
            super().apply(fn)
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FullyShardedDataParallel:
        """Conversions that keep every flat parameter's dtype and device pass (``to`` the device
        it is on, ``share_memory``); ``ValueError`` for one that would change them (``to(dtype)``,
        ``double()``, ``cuda()``): the flat parameters are laid out at wrapping."""
        for h in self._tree.flat_handles:
            probe = fn(torch.empty(0, dtype=h.orig_dtype, device=h.local.device))
            if probe.dtype != h.orig_dtype or probe.device != h.local.device:
                raise ValueError(
                    f"to: the parameters' dtype and device are fixed when FSDP wraps them ({h.orig_dtype} on "
                    f"{h.local.device}; asked for {probe.dtype} on {probe.device}); convert the module before "
                    "wrapping it, or use mixed_precision= for low-precision compute"
                )
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # nn.Module._apply is unannotated
        return self

    def __getitem__(self, key: int) -> Any:
        """FSDP1's indexing of a wrapped ``nn.Sequential`` or ``nn.ModuleList``."""
        return self.module[key]  # type: ignore[index]  # only Sequential-like modules are subscriptable, as in FSDP1

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module``'s, with FSDP1's names (``_fsdp_wrapped_module.`` segments), which inside
        ``summon_full_params`` are dropped, as FSDP1 does."""
        clean = self._tree.summoning > 0
        for name, p in super().named_parameters(*args, **kwargs):
            yield (name.replace(WRAPPED_MODULE + ".", "") if clean else name), p

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``nn.Module``'s, named as ``named_parameters``."""
        clean = self._tree.summoning > 0
        for name, b in super().named_buffers(*args, **kwargs):
            yield (name.replace(WRAPPED_MODULE + ".", "") if clean else name), b

    # -- configuration --------------------------------------------------------------------------

    @property
    def mixed_precision(self) -> MixedPrecision:
        """FSDP1's attribute: the tree's mixed precision (fsdp_core's ``MixedPrecision``)."""
        return self._tree.options.mixed_precision

    @property
    def cpu_offload(self) -> CPUOffload:
        """FSDP1's attribute: the tree's CPU offload (fsdp_core's ``CPUOffload``)."""
        return self._tree.options.offload

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        """FSDP1's attribute."""
        return self._tree.options.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        """FSDP1's attribute."""
        return self._tree.options.forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        """FSDP1's attribute."""
        return self._tree.options.limit_all_gathers

    @property
    def use_orig_params(self) -> bool:
        """FSDP1's ``_use_orig_params``, public here."""
        return self._tree.options.use_orig_params

    @property
    def compute_device(self) -> torch.device:
        """FSDP1's attribute: where the unsharded parameters compute."""
        return self._tree.device

    @property
    def rank(self) -> int:
        """FSDP1's attribute: this rank in the shard group."""
        return self._tree.groups.shard.rank()

    @property
    def world_size(self) -> int:
        """FSDP1's attribute: the shard group's size."""
        return self._tree.groups.shard_size

    @property
    def params(self) -> list[nn.Parameter]:
        """FSDP1's attribute: this unit's flat parameter (none when it owns no parameter, or with
        ``use_orig_params`` its original parameters)."""
        h = self._tree.handles[self._index]
        if h is None:
            return []
        return list(h.orig_params) if h.use_orig_params else [h.flat_param]

    @property
    def training_state(self) -> TrainingState:
        """FSDP1's attribute (torch's ``TrainingState``): ``SUMMON_FULL_PARAMS`` inside
        ``summon_full_params``, ``FORWARD_BACKWARD`` from the root's forward to the end of its
        backward, else ``IDLE``."""
        tree = self._tree
        if tree.summoning:
            return TrainingState.SUMMON_FULL_PARAMS
        if tree.iteration.unfinished or tree.iteration.events:
            return TrainingState.FORWARD_BACKWARD
        return TrainingState.IDLE

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
        return self._tree.options.strategy

    def _flat_handles(self) -> list[FlatParamHandle]:
        """The flat parameter of every unit of this tree, in unit order (children first)."""
        self._require_root("_flat_handles")
        return self._tree.flat_handles

    def collective_counts(self) -> dict[CollectiveKind, int]:
        """How many collectives of each kind, ``(op, group, dtype, numel)``, the runtime has
        issued so far (all-gathers, reductions, comm hooks): one entry per kind, so it does not
        grow with the steps. Subtract two readings to count a step."""
        return dict(self._tree.log.counts)

    def watch_collectives(self) -> contextlib.AbstractContextManager[list[CollectiveRecord]]:
        """``with model.watch_collectives() as seen:`` ``seen`` receives every collective the
        runtime issues inside, ``(op, group, dtype, numel, phase)``, in issue order within each
        group; nothing is recorded outside such a block."""
        return self._tree.log.watching()

    def _set(self, **changes: Any) -> None:
        tree = self._tree
        tree.settings = dataclasses.replace(tree.settings, **changes)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate the unsharded gradient locally; nothing is communicated."""
        self._require_root("no_sync")
        previous = self._tree.settings.sync_gradients
        self._set(sync_gradients=False)
        try:
            yield
        finally:
            self._set(sync_gradients=previous)

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        """Hybrid only: False defers the replicate all-reduce, keeping a partial reduction that
        the next backward with True folds in (FSDP2's gradient-accumulation saving)."""
        self._require_root("set_requires_all_reduce")
        flag("requires_all_reduce", requires_all_reduce)
        strategy = self._tree.options.strategy
        if not requires_all_reduce and not strategy.is_hybrid:
            raise ValueError(
                f"requires_all_reduce: only hybrid strategies can defer the all-reduce, not {strategy.name}"
            )
        self._set(requires_all_reduce=requires_all_reduce)

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        """FSDP2's ``set_gradient_divide_factor``: divide the summed gradient by ``factor``
        instead of the data-parallel size (None restores the average). Not with a comm hook,
        whose state divides."""
        self._require_root("set_gradient_divide_factor")
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))):
            raise TypeError(f"factor: expected a positive number or None, got {factor!r}")
        division = dataclasses.replace(self._tree.settings.division, factor=None if factor is None else float(factor))
        self._replan(division=division)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Replace the shard-group collective by ``hook(state, grad, output=None)`` (FSDP1's signature)."""
        self._require_root("register_comm_hook")
        tree = self._tree
        if tree.settings.comm_hook is not None:
            raise ValueError("hook: a communication hook is already registered; FSDP takes one")
        if tree.first_forward_done:
            raise ValueError("hook: register the communication hook before the first forward (as in FSDP1)")
        bound, kind = comm_hooks.bind(state, hook, tree.options.strategy)
        self._replan(comm_hook=bound, comm_hook_kind=kind)

    def _replan(self, **changes: Any) -> None:
        """Apply ``changes`` to the settings the plans are made from; a combination the core
        rejects raises here (building every unit's request), before anything has changed."""
        tree = self._tree
        settings = dataclasses.replace(tree.settings, **changes)
        for h in tree.flat_handles:
            settings.request(h.request)
        tree.settings = settings

    # -- summoning and the units ----------------------------------------------------------------

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """FSDP1's context manager: inside, the original parameters of every unit in ``module``
        (only ``module``'s own unit with ``recurse=False``) hold their full values in their own
        dtype and shape; with ``writeback`` (default) what is changed inside is kept;
        ``rank0_only``: only rank 0 sees them; ``offload_to_cpu``: on the host; ``with_grads``
        (``use_orig_params``): their gradients too. A collective; not inside forward or backward
        (``fsdp_shell.units.summon``)."""
        flags = ("recurse", recurse), ("writeback", writeback), ("rank0_only", rank0_only)
        for name, value in (*flags, ("offload_to_cpu", offload_to_cpu), ("with_grads", with_grads)):
            flag(name, value)
        if recurse:
            units = FullyShardedDataParallel.fsdp_modules(module)
        elif isinstance(module, FullyShardedDataParallel):
            units = [module]
        else:
            raise ValueError(
                "module: recurse=False summons one unit's parameters; pass a FullyShardedDataParallel module"
            )
        if not units:
            raise ValueError("module: contains no FullyShardedDataParallel module")
        with summoned_trees(
            [(unit._tree, unit._tree.handles[unit._index]) for unit in units],
            writeback=writeback,
            rank0_only=rank0_only,
            offload_to_cpu=offload_to_cpu,
            with_grads=with_grads,
        ):
            yield

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """FSDP1's: every ``FullyShardedDataParallel`` in ``module`` (itself included), or only
        the roots."""
        if root_only:
            return [m for m in roots(module) if isinstance(m, FullyShardedDataParallel)]
        return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]

    def check_is_root(self) -> bool:
        """FSDP1's: whether this module is the root of its FSDP tree."""
        return self._is_root

    # -- clipping -------------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float | str = 2.0) -> torch.Tensor:
        """Clip all gradients by their total norm across all shards; returns that norm."""
        self._require_root("clip_grad_norm_")
        tree = self._tree
        ignored = [p for _, p in tree.ignored_params]
        return clip_grad_norm(tree.flat_handles, tree.groups.shard, tree.device, max_norm, norm_type, ignored)


FSDP = FullyShardedDataParallel
