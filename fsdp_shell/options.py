"""The constructor's arguments that shape a whole FSDP tree, validated before any collective.

``parse_options`` checks every argument that needs no process group (``ValueError``/``TypeError``
naming it) and returns one frozen ``Options``. ``torch.distributed.fsdp``'s config objects are
accepted as well as fsdp_core's, mapped by name (``to_*``); ``wrap_policy`` turns
``auto_wrap_policy`` into FSDP1's policy protocol (or torch's policy object).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_core import (
    BackwardPrefetch,
    CPUOffload,
    DivisionPolicy,
    HybridAllReduce,
    MixedPrecision,
    ShardingStrategy,
    parse_member,
)

__all__ = [
    "Ignored",
    "Options",
    "SubtreePolicy",
    "TargetPolicy",
    "WrapPolicy",
    "check_mixed_precision",
    "flag",
    "parse_options",
    "to_backward_prefetch",
    "to_cpu_offload",
    "to_division_policy",
    "to_hybrid_all_reduce",
    "to_ignored",
    "to_mixed_precision",
    "to_param_init_fn",
    "to_sharding_strategy",
    "wrap_policy",
]

SubtreePolicy = Callable[[nn.Module, bool, int], bool]
"""FSDP1's auto-wrap protocol, ``policy(module, recurse, nonwrapped_numel)``: with ``recurse``
True, whether to look into ``module``'s children; with False, whether ``module`` becomes a unit,
given how many parameter elements of its subtree no unit below it holds."""


@dataclass(frozen=True, slots=True, eq=False)
class TargetPolicy:
    """A torch ``_Policy`` that names its units itself from the root (``CustomPolicy``)."""

    policy: object

    def targets(self, root: nn.Module) -> frozenset[int]:
        """The ``id`` of every module the policy makes a unit; ``ValueError`` for per-unit
        arguments, which every unit of one tree shares here."""
        chosen: dict[nn.Module, dict[str, object]] = self.policy._run_policy(root, set(), {})  # type: ignore[attr-defined]  # torch's private _Policy protocol
        overrides = sorted({k for kwargs in chosen.values() for k in kwargs})
        if overrides:
            raise ValueError(
                f"auto_wrap_policy: the policy gives units arguments of their own ({', '.join(overrides)}); "
                "every unit of a tree shares the constructor's arguments here, so return True instead"
            )
        return frozenset(id(m) for m in chosen)


WrapPolicy = SubtreePolicy | TargetPolicy


@dataclass(frozen=True, slots=True, kw_only=True)
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
    param_init_fn: Callable[[nn.Module], None] | None = None
    sync_module_states: bool = False
    limit_all_gathers: bool = True


def parse_options(
    *,
    sharding_strategy: object,
    cpu_offload: object,
    auto_wrap_policy: object,
    mixed_precision: object,
    use_orig_params: object,
    backward_prefetch: object,
    forward_prefetch: object,
    division_policy: object,
    hybrid_all_reduce: object,
    ranks_may_diverge: object = False,
    param_init_fn: object = None,
    sync_module_states: object = False,
    limit_all_gathers: object = True,
) -> Options:
    """Every argument checked on its own and against the others; ``ValueError``/``TypeError``
    naming the argument."""
    strategy = to_sharding_strategy(ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy)
    placement = to_hybrid_all_reduce(hybrid_all_reduce)
    if placement is HybridAllReduce.SYNC and not strategy.is_hybrid:
        raise ValueError(
            f"hybrid_all_reduce: 'sync' places the replicate all-reduce of hybrid strategies; "
            f"{strategy.name} has none (leave it 'async')"
        )
    return Options(
        strategy=strategy,
        mixed_precision=to_mixed_precision(mixed_precision),
        offload=to_cpu_offload(cpu_offload),
        use_orig_params=flag("use_orig_params", use_orig_params),
        backward_prefetch=to_backward_prefetch(backward_prefetch),
        forward_prefetch=flag("forward_prefetch", forward_prefetch),
        division_policy=to_division_policy(division_policy),
        hybrid_all_reduce=placement,
        wrap=wrap_policy(auto_wrap_policy),
        ranks_may_diverge=flag("ranks_may_diverge", ranks_may_diverge),
        param_init_fn=to_param_init_fn(param_init_fn),
        sync_module_states=flag("sync_module_states", sync_module_states),
        limit_all_gathers=flag("limit_all_gathers", limit_all_gathers),
    )


@dataclass(frozen=True, slots=True, eq=False)
class Ignored:
    """FSDP1's ``ignored_modules`` / ``ignored_states``: what FSDP leaves alone. Ignored modules
    (with their descendants) are never units, not materialized, moved, broadcast or cast; their
    parameters, and ignored parameters, are not flattened, sharded or reduced: they stay as they
    are on each rank, in ``parameters()``, the state dicts and the optimizer state dicts."""

    modules: frozenset[int] = frozenset()
    """``id`` of every ignored module and of its descendants."""
    params: frozenset[int] = frozenset()
    """``id`` of every ignored parameter (those of ignored modules included)."""

    def skips(self, module: nn.Module) -> bool:
        return id(module) in self.modules


def to_ignored(
    module: nn.Module, ignored_modules: object, ignored_states: object, is_wrapped: Callable[[nn.Module], bool]
) -> Ignored:
    """``ignored_modules`` (modules) or ``ignored_states`` (all parameters or all modules) of
    ``module``'s subtree, checked as FSDP1 checks them; ``TypeError``/``ValueError`` naming the
    argument."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("ignored_modules, ignored_states: pass one of them (ignored_modules is the older name)")
    argument, given = (
        ("ignored_states", ignored_states)
        if ignored_states is not None
        else (
            "ignored_modules",
            ignored_modules,
        )
    )
    if given is None:
        return Ignored()
    if isinstance(given, (nn.Module, torch.Tensor)) or not hasattr(given, "__iter__"):
        raise TypeError(f"{argument}: expected an iterable of nn.Module or nn.Parameter, got {given!r}")
    items = list(given)
    params = [x for x in items if isinstance(x, nn.Parameter)]
    modules = [x for x in items if isinstance(x, nn.Module)]
    if len(params) + len(modules) != len(items):
        raise TypeError(f"{argument}: expected nn.Module or nn.Parameter items, got {items!r}")
    if params and (modules or argument == "ignored_modules"):
        raise ValueError(f"{argument}: ignored_states takes parameters or modules, not both; ignored_modules modules")
    inside = {id(m) for m in module.modules()}
    owned = {id(p) for p in module.parameters()}
    for m in modules:
        if id(m) not in inside:
            raise ValueError(f"{argument}: {type(m).__name__} is not a submodule of the wrapped module")
        if m is module:
            raise ValueError(f"{argument}: the wrapped module itself; there would be nothing to shard")
        if is_wrapped(m):
            raise ValueError(f"{argument}: holds a FullyShardedDataParallel module; ignore the module it wraps")
    for p in params:
        if id(p) not in owned:
            raise ValueError(f"{argument}: a parameter of shape {tuple(p.shape)} is not one of the wrapped module's")
    ignored_modules_all = {id(sub) for m in modules for sub in m.modules()}
    ignored_params = {id(p) for m in modules for p in m.parameters()} | {id(p) for p in params}
    return Ignored(modules=frozenset(ignored_modules_all), params=frozenset(ignored_params))


def to_param_init_fn(value: object) -> Callable[[nn.Module], None] | None:
    """``param_init_fn`` as FSDP1 takes it: None or a ``callable(module)``."""
    if value is None:
        return None
    if not callable(value):
        raise TypeError(f"param_init_fn: expected None or a callable(module), got {value!r}")
    fn = value

    def init(module: nn.Module) -> None:
        fn(module)

    return init


def flag(name: str, value: object) -> bool:
    """``value`` if it is a bool; ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return value


def wrap_policy(auto_wrap_policy: object) -> WrapPolicy | None:
    """``auto_wrap_policy`` in FSDP1's protocol (``SubtreePolicy``), or torch's ``_Policy``
    object (``TargetPolicy``); ``TypeError`` naming it otherwise. Accepted: a set of module
    classes, ``ModuleWrapPolicy``, ``CustomPolicy``, torch's policy functions
    (``transformer_auto_wrap_policy``, ``size_based_auto_wrap_policy``, ``lambda_auto_wrap_policy``,
    as ``functools.partial``) and any ``callable(module, recurse, nonwrapped_numel) -> bool``,
    or a ``callable(module) -> bool``."""
    if auto_wrap_policy is None:
        return None
    if isinstance(auto_wrap_policy, type) and issubclass(auto_wrap_policy, nn.Module):
        raise TypeError(
            f"auto_wrap_policy: got the class {auto_wrap_policy.__name__} itself; pass a set of classes, "
            f"{{{auto_wrap_policy.__name__}}}, or ModuleWrapPolicy({{{auto_wrap_policy.__name__}}})"
        )
    classes = getattr(auto_wrap_policy, "_module_classes", None)
    if classes is not None:
        auto_wrap_policy = set(classes)
    if isinstance(auto_wrap_policy, (set, frozenset, list, tuple)):
        kinds = tuple(auto_wrap_policy)
        if not all(isinstance(k, type) and issubclass(k, nn.Module) for k in kinds):
            raise TypeError("auto_wrap_policy: a set must hold nn.Module classes")
        return lambda m, recurse, numel: recurse or isinstance(m, kinds)
    if callable(getattr(auto_wrap_policy, "_run_policy", None)):
        return TargetPolicy(auto_wrap_policy)
    if callable(auto_wrap_policy):
        policy = auto_wrap_policy
        if _takes_subtree_arguments(policy):
            return lambda m, recurse, numel: bool(policy(module=m, recurse=recurse, nonwrapped_numel=numel))
        return lambda m, recurse, numel: recurse or bool(policy(m))
    raise TypeError(
        "auto_wrap_policy: expected None, a set of nn.Module classes, torch's ModuleWrapPolicy or "
        "CustomPolicy, a callable(module, recurse, nonwrapped_numel) -> bool or a "
        f"callable(module) -> bool; got {auto_wrap_policy!r}"
    )


def _takes_subtree_arguments(policy: Callable[..., object]) -> bool:
    """Whether ``policy`` takes FSDP1's ``(module, recurse, nonwrapped_numel)`` by name."""
    try:
        inspect.signature(policy).bind(module=None, recurse=True, nonwrapped_numel=0)
    except (TypeError, ValueError):
        return False
    return True


def to_sharding_strategy(value: object) -> ShardingStrategy:
    """fsdp_core's member of the same name as ``value`` (ours, torch's, or a string)."""
    if isinstance(value, ShardingStrategy):
        return value
    name = getattr(value, "name", value)
    if isinstance(name, str):
        return ShardingStrategy.parse(name)
    accepted = ", ".join(m.name for m in ShardingStrategy)
    raise TypeError(f"sharding_strategy: expected a ShardingStrategy ({accepted}), got {value!r}")


def to_mixed_precision(value: object) -> MixedPrecision:
    """fsdp_core's ``MixedPrecision`` from ours, torch's (same field names) or None. Torch's
    ``_module_classes_to_ignore`` is checked against the model by ``check_mixed_precision``."""
    if value is None:
        return MixedPrecision()
    if isinstance(value, MixedPrecision):
        return value
    fields = ("param_dtype", "reduce_dtype", "keep_low_precision_grads")
    if all(hasattr(value, f) for f in fields):
        optional = {"buffer_dtype": None, "cast_forward_inputs": False, "cast_root_forward_inputs": True}
        given = {f: getattr(value, f) for f in fields} | {f: getattr(value, f, d) for f, d in optional.items()}
        return MixedPrecision(**given)
    raise TypeError(f"mixed_precision: expected None or a MixedPrecision (fsdp_core's or torch's), got {value!r}")


def check_mixed_precision(module: nn.Module, mixed_precision: object, options: Options) -> None:
    """FSDP1 wraps modules of ``mixed_precision._module_classes_to_ignore`` (torch's default:
    batch norms) in full-precision units of their own when an ``auto_wrap_policy`` is given;
    every unit of a tree here shares one mixed precision, so such a model is refused, naming the
    modules and the choices."""
    mp = options.mixed_precision
    low = mp.param_dtype is not None or mp.reduce_dtype is not None or mp.buffer_dtype is not None
    classes = tuple(getattr(mixed_precision, "_module_classes_to_ignore", ()) or ())
    if options.wrap is None or not low or not classes:
        return
    found = [
        f"{name or 'the root module'} ({type(m).__name__})"
        for name, m in module.named_modules()
        if isinstance(m, classes)
    ]
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise ValueError(
            f"mixed_precision: FSDP1 keeps {shown} (its _module_classes_to_ignore: "
            f"{', '.join(c.__name__ for c in classes)}) in full precision in units of their own; here every "
            "unit of a tree shares one mixed precision. Pass torch's MixedPrecision(..., "
            "_module_classes_to_ignore=()) to run them in param_dtype too, or fsdp_core's MixedPrecision"
        )


def to_cpu_offload(value: object) -> CPUOffload:
    """fsdp_core's ``CPUOffload`` from ours, torch's or None."""
    if value is None:
        return CPUOffload()
    if isinstance(value, CPUOffload):
        return value
    offload = getattr(value, "offload_params", None)
    if isinstance(offload, bool):
        return CPUOffload(offload_params=offload)
    raise TypeError(f"cpu_offload: expected None or a CPUOffload (fsdp_core's or torch's), got {value!r}")


def to_backward_prefetch(value: object) -> BackwardPrefetch | None:
    """fsdp_core's ``BackwardPrefetch`` member of the same name as ``value`` (ours, torch's
    ``torch.distributed.fsdp.BackwardPrefetch``, or a string, any case), or None for None or
    ``"none"``."""
    if value is None or isinstance(value, BackwardPrefetch):
        return value
    if isinstance(value, str):
        return None if value.strip().lower() == "none" else BackwardPrefetch.parse(value)
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return BackwardPrefetch.parse(name)
    raise TypeError(
        f"backward_prefetch: expected None or a BackwardPrefetch (BACKWARD_PRE, BACKWARD_POST; fsdp_core's "
        f"or torch's), got {value!r}"
    )


def to_division_policy(value: object) -> DivisionPolicy:
    """``DivisionPolicy`` from itself or its value (``"pre_post"``, ``"in_collective"``)."""
    if isinstance(value, DivisionPolicy):
        return value
    if isinstance(value, str):
        return parse_member(DivisionPolicy, value, argument="division_policy", noun="policy", by_value=True)
    raise TypeError(f"division_policy: expected a DivisionPolicy or its value, got {value!r}")


def to_hybrid_all_reduce(value: object) -> HybridAllReduce:
    """``HybridAllReduce`` from itself or its value (``"async"``, ``"sync"``)."""
    if isinstance(value, HybridAllReduce):
        return value
    if isinstance(value, str):
        return HybridAllReduce.parse(value)
    raise TypeError(f"hybrid_all_reduce: expected 'async', 'sync' or a HybridAllReduce, got {value!r}")
