"""Which modules become FSDP units, and each unit's flat parameter.

``find_units`` lists the units bottom-up, as FSDP1 wraps them: every submodule the wrap policy
selects that holds parameters, after its own descendants, siblings in registration order, and
the root last. ``unit_params`` then takes, in that order, the parameters each unit's module
owns outside nested units; a parameter another unit has already taken is refused (FSDP1 too
needs every use of a shared parameter inside the unit that flattens it). ``unit_request`` lays
them out as one flat parameter and gives the unit's plan request, and ``build_handles`` makes a
``FlatParamHandle`` of each (the prediction of ``fsdp_shell.predict`` uses the same three, with
no process group).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp_core import CommHook, Division, FlatParamLayout, PlanRequest, ShardingSpec
from fsdp_shell.options import Options, SubtreePolicy, TargetPolicy, WrapPolicy
from fsdp_shell.runtime.protocol import Runtime
from fsdp_shell.units.flat_param import FlatParamHandle, OrigParam
from fsdp_shell.units.gather_limit import GatherLimiter

__all__ = ["OwnedParams", "UnitSite", "build_handles", "find_units", "param_names", "unit_params", "unit_request"]

OwnedParams = list[tuple[OrigParam, nn.Parameter]]
"""The parameters one unit flattens, each with where it is registered."""


@dataclass(frozen=True, slots=True, eq=False)
class UnitSite:
    """A module that becomes a unit, and where it is registered: ``parent.<attr>`` (None and ""
    for the root)."""

    module: nn.Module
    parent: nn.Module | None
    attr: str


def find_units(
    module: nn.Module,
    policy: WrapPolicy | None,
    is_wrapped: Callable[[nn.Module], bool],
    ignored: frozenset[int] = frozenset(),
) -> list[UnitSite]:
    """The units of ``module`` bottom-up, the root last, chosen as FSDP1's ``_recursive_wrap``
    does: the policy is asked, from the root down, whether to look into a module's children
    (``recurse=True``) and, after them, whether the module becomes a unit given the parameter
    elements of its subtree that no unit below holds. A module with no parameters in its
    subtree never becomes a unit. Submodules already wrapped (``is_wrapped``: an FSDP tree of their
    own, or ignored) are left alone with their descendants, and their parameters are not counted,
    nor the ``ignored`` parameters (by ``id``)."""
    found: list[UnitSite] = []
    decide: SubtreePolicy | None
    if isinstance(policy, TargetPolicy):
        targets = policy.targets(module)
        decide = lambda m, recurse, numel: recurse or id(m) in targets  # noqa: E731
    else:
        decide = policy

    def unwrapped(m: nn.Module, seen: dict[int, int]) -> dict[int, int]:
        for p in m.parameters(recurse=False):
            if id(p) not in ignored:
                seen.setdefault(id(p), p.numel())
        for child in m.children():
            if not is_wrapped(child):
                unwrapped(child, seen)
        return seen

    def visit(m: nn.Module, rule: SubtreePolicy) -> int:
        """Units under ``m``; returns the parameter elements they hold."""
        held = 0
        for name, child in list(m.named_children()):
            if is_wrapped(child):
                continue
            numel = sum(unwrapped(child, {}).values())
            if not rule(child, True, numel):
                continue
            inner = visit(child, rule)
            if any(id(p) not in ignored for p in child.parameters()) and rule(child, False, numel - inner):
                found.append(UnitSite(child, m, name))
                held += numel
            else:
                held += inner
        return held

    if decide is not None and decide(module, True, sum(unwrapped(module, {}).values())):
        visit(module, decide)
    found.append(UnitSite(module, None, ""))
    return found


def param_names(module: nn.Module) -> dict[int, str]:
    """Every parameter of ``module`` by ``id``: its first name in the unwrapped model."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    if not names:
        raise ValueError(f"module: {type(module).__name__} has no parameters; there is nothing to shard")
    return names


def unit_params(
    sites: Sequence[UnitSite],
    names: Mapping[int, str],
    is_wrapped: Callable[[nn.Module], bool],
    ignored: frozenset[int] = frozenset(),
) -> list[OwnedParams]:
    """Each site's parameters, in the sites' order (empty for a unit that owns none)."""
    units = {id(s.module) for s in sites}
    owners: dict[int, str] = {}
    return [
        _owned_params(site.module, names, owners, lambda m: id(m) in units or is_wrapped(m), ignored) for site in sites
    ]


def build_handles(
    sites: Sequence[UnitSite],
    names: Mapping[int, str],
    options: Options,
    *,
    division: Division,
    sharding: ShardingSpec,
    runtime: Runtime,
    shard_group: dist.ProcessGroup,
    device: torch.device,
    is_wrapped: Callable[[nn.Module], bool],
    ignored: frozenset[int] = frozenset(),
) -> tuple[FlatParamHandle | None, ...]:
    """Each site's flat parameter (None for a unit that owns no parameter), in the sites' order,
    sharing one all-gather rate limiter (``limit_all_gathers``, where the runtime's frees lag
    behind the host: ``Runtime.frees_at_once``)."""
    limiter = GatherLimiter(runtime) if options.limit_all_gathers and not runtime.frees_at_once else None
    handles: list[FlatParamHandle | None] = []
    for owned in unit_params(sites, names, is_wrapped, ignored):
        if not owned:
            handles.append(None)
            continue
        handles.append(
            FlatParamHandle(
                [o for o, _ in owned],
                [t for _, t in owned],
                base_request=unit_request(owned, options, division, sharding),
                runtime=runtime,
                shard_group=shard_group,
                device=device,
                limiter=limiter,
            )
        )
    return tuple(handles)


def _owned_params(
    module: nn.Module,
    names: Mapping[int, str],
    owners: dict[int, str],
    is_unit: Callable[[nn.Module], bool],
    ignored: frozenset[int],
) -> list[tuple[OrigParam, nn.Parameter]]:
    """The parameters ``module`` owns outside nested units, with their unwrapped names, each
    once (a tied parameter with its further registrations as aliases); ``owners`` records which
    unit flattened each one."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    tensors: dict[int, nn.Parameter] = {}

    def visit(m: nn.Module) -> None:
        for attr, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            owner = owners.get(id(p))
            if owner is not None:
                prefix = names[id(p)].rpartition(".")[0]
                raise ValueError(
                    f"module: parameter {names[id(p)]} is shared across FSDP units: the unit of "
                    f"{owner!r} flattened it and {type(m).__name__}.{attr} of another unit uses it too; "
                    f"a shared parameter must be used inside one unit, so wrap both uses in one (their "
                    f"lowest common ancestor), e.g. keep {prefix or 'its module'} out of auto_wrap_policy"
                )
            slots.setdefault(id(p), []).append((m, attr))
            tensors[id(p)] = p
        for child in m.children():
            if not is_unit(child):
                visit(child)

    visit(module)
    out: list[tuple[OrigParam, nn.Parameter]] = []
    for key, ((m, attr), *aliases) in slots.items():
        out.append((OrigParam(module=m, attr=attr, fqn=names[key], aliases=tuple(aliases)), tensors[key]))
    label = type(module).__name__ + (f" holding {out[0][0].fqn}" if out else "")
    for key in slots:
        owners[key] = label
    return out


def unit_request(owned: OwnedParams, options: Options, division: Division, sharding: ShardingSpec) -> PlanRequest:
    """The plan request of the unit flattening ``owned``, without this step's flags: its layout
    (FSDP1's alignment with ``use_orig_params``) and the tree's options. ``ValueError`` for
    parameters of several dtypes, or frozen beside trainable ones without ``use_orig_params``."""
    tensors = [t for _, t in owned]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"module: one FSDP unit needs one parameter dtype, got {sorted(map(str, dtypes))}")
    if len({t.requires_grad for t in tensors}) != 1 and not options.use_orig_params:
        frozen = [p.fqn for p, t in owned if not t.requires_grad]
        raise ValueError(
            f"module: frozen parameters ({', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''}) "
            "beside trainable ones in one FSDP unit need use_orig_params=True (as in FSDP1), "
            "or wrap the frozen ones in a unit of their own"
        )
    (dtype,) = dtypes
    compute = options.mixed_precision.compute_dtype(dtype)
    layout = FlatParamLayout.of(
        [(p.fqn, tuple(t.shape)) for p, t in owned], dtype, align=options.use_orig_params, align_dtype=compute
    )
    return PlanRequest(
        layout=layout,
        sharding=sharding,
        mixed_precision=options.mixed_precision,
        offload=options.offload,
        comm_hook=CommHook.NONE,
        division=division,
        use_orig_params=options.use_orig_params,
        hybrid_all_reduce=options.hybrid_all_reduce,
    )
