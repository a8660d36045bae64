"""State dicts with the unwrapped module's own semantics: full or sharded (DTensor), as FSDP1.

The keys are exactly those ``module.state_dict()`` of the unwrapped module gives (every name a
shared parameter is registered under, persistent buffers only, ``_extra_state`` where a module
defines it), in the same order, recorded once at construction as ``StateEntry`` values.

- ``full_state_dict``: every parameter's full value on every rank (one all-gather per unit).
- ``sharded_state_dict``: every parameter as a ``DTensor`` sharded on dim 0 over the shard
  group (unpadded, original shape), which ``torch.distributed.checkpoint`` saves and loads across
  world sizes; buffers and extra state as they are.
- ``load_state_dict``: the inverse of both, with ``nn.Module.load_state_dict``'s ``strict`` and
  its ``(missing_keys, unexpected_keys)`` result.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.fsdp.api as fsdp_api
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.modules.module import _IncompatibleKeys

from fsdp_shell.units.flat_param import FlatParamHandle

__all__ = [
    "EntryKind",
    "StateDictSettings",
    "StateDictType",
    "StateEntry",
    "full_state_dict",
    "full_tensor",
    "load_state_dict",
    "sharded_state_dict",
    "state_dict_settings",
    "state_entries",
    "torch_settings",
]


class StateDictType(enum.Enum):
    """What ``state_dict()`` returns (FSDP1's names; ``LOCAL_STATE_DICT`` is not offered)."""

    FULL_STATE_DICT = "full"
    SHARDED_STATE_DICT = "sharded"


@dataclass(frozen=True, slots=True)
class StateDictSettings:
    """``state_dict()``'s kind and FSDP1's config flags: ``offload_to_cpu`` (values on the
    host), ``rank0_only`` (full only: ranks other than 0 get an empty dict)."""

    kind: StateDictType = StateDictType.FULL_STATE_DICT
    offload_to_cpu: bool = False
    rank0_only: bool = False


def torch_settings(settings: StateDictSettings) -> fsdp_api.StateDictSettings:
    """``settings`` as FSDP1's ``get_state_dict_type`` returns them (torch's config objects)."""
    config: fsdp_api.StateDictConfig
    optim: fsdp_api.OptimStateDictConfig
    if settings.kind is StateDictType.FULL_STATE_DICT:
        config = fsdp_api.FullStateDictConfig(offload_to_cpu=settings.offload_to_cpu, rank0_only=settings.rank0_only)
        optim = fsdp_api.FullOptimStateDictConfig(
            offload_to_cpu=settings.offload_to_cpu, rank0_only=settings.rank0_only
        )
    else:
        config = fsdp_api.ShardedStateDictConfig(offload_to_cpu=settings.offload_to_cpu)
        optim = fsdp_api.ShardedOptimStateDictConfig(offload_to_cpu=settings.offload_to_cpu)
    return fsdp_api.StateDictSettings(fsdp_api.StateDictType[settings.kind.name], config, optim)


def state_dict_settings(state_dict_type: object, state_dict_config: object = None) -> StateDictSettings:
    """Ours or torch's ``StateDictType`` (by name) with torch's ``FullStateDictConfig`` /
    ``ShardedStateDictConfig`` (or None), checked."""
    name = getattr(state_dict_type, "name", state_dict_type)
    if name == "LOCAL_STATE_DICT":
        raise ValueError(
            "state_dict_type: LOCAL_STATE_DICT (flat, padded shards) is not offered; "
            "use SHARDED_STATE_DICT, which torch.distributed.checkpoint loads at any world size"
        )
    if not isinstance(name, str) or name not in StateDictType.__members__:
        raise ValueError(
            f"state_dict_type: expected StateDictType.FULL_STATE_DICT or SHARDED_STATE_DICT "
            f"(ours or torch.distributed.fsdp's), got {state_dict_type!r}"
        )
    kind = StateDictType[name]
    offload = _flag(state_dict_config, "offload_to_cpu")
    rank0_only = _flag(state_dict_config, "rank0_only")
    if rank0_only and kind is not StateDictType.FULL_STATE_DICT:
        raise ValueError("state_dict_config: rank0_only applies to FULL_STATE_DICT only")
    return StateDictSettings(kind=kind, offload_to_cpu=offload, rank0_only=rank0_only)


def _flag(config: object, name: str) -> bool:
    value = getattr(config, name, False)
    if not isinstance(value, bool):
        raise TypeError(f"state_dict_config.{name}: expected a bool, got {value!r}")
    return value


class EntryKind(enum.Enum):
    PARAM = "param"
    IGNORED = "ignored"
    """A parameter FSDP leaves alone (``ignored_modules``/``ignored_states``): its own value."""
    BUFFER = "buffer"
    EXTRA = "extra_state"


@dataclass(frozen=True, slots=True, eq=False)
class StateEntry:
    """One key of the unwrapped module's ``state_dict()``: where its value lives. ``param`` is
    the parameter's first name (the one its flat parameter knows it by)."""

    key: str
    kind: EntryKind
    module: nn.Module
    attr: str
    param: str = ""
    dtype: torch.dtype | None = None
    """A buffer's dtype in the unwrapped module: state dicts give it so, whatever
    ``MixedPrecision.buffer_dtype`` keeps it in."""


def state_entries(
    module: nn.Module, param_names: Mapping[int, str], ignored: frozenset[int] = frozenset()
) -> tuple[StateEntry, ...]:
    """The keys ``module.state_dict()`` gives, in its order, read before the module is wrapped.

    Where a value lives comes from walking the modules as ``state_dict`` does; the keys come
    from ``module.state_dict(keep_vars=True)`` itself, so hooks that rename keys (such as
    ``checkpoint_wrapper``'s, which drops ``_checkpoint_wrapped_module.``) are kept. Hooks that
    add, drop or replace entries are refused."""
    walked = list(_walk(module, "", param_names, ignored))
    final = module.state_dict(keep_vars=True)
    same = len(final) == len(walked) and all(
        e.kind is EntryKind.EXTRA or value is _value(e) for e, value in zip(walked, final.values())
    )
    if not same:
        raise ValueError(
            "module: its state_dict hooks add, drop or replace entries; FSDP cannot map "
            "its state dict onto the sharded parameters"
        )
    return tuple(dataclasses.replace(e, key=key) for e, key in zip(walked, final))


def _value(e: StateEntry) -> object:
    return e.module._buffers[e.attr] if e.kind is EntryKind.BUFFER else e.module._parameters[e.attr]


def _walk(module: nn.Module, prefix: str, names: Mapping[int, str], ignored: frozenset[int]) -> Iterator[StateEntry]:
    for attr, p in module._parameters.items():
        if p is not None:
            kind = EntryKind.IGNORED if id(p) in ignored else EntryKind.PARAM
            yield StateEntry(prefix + attr, kind, module, attr, names[id(p)])
    for attr, b in module._buffers.items():
        if b is not None and attr not in module._non_persistent_buffers_set:
            yield StateEntry(prefix + attr, EntryKind.BUFFER, module, attr, dtype=b.dtype)
    if type(module).get_extra_state is not nn.Module.get_extra_state:
        yield StateEntry(prefix + "_extra_state", EntryKind.EXTRA, module, "")
    for name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, f"{prefix}{name}.", names, ignored)


def _buffer(entry: StateEntry) -> torch.Tensor:
    buf = entry.module._buffers[entry.attr]
    if buf is None:
        raise RuntimeError(f"buffer {entry.key} was set to None after wrapping")
    return buf


def _ignored(entry: StateEntry) -> torch.Tensor:
    p = entry.module._parameters[entry.attr]
    if p is None:
        raise RuntimeError(f"parameter {entry.key} was set to None after wrapping")
    return p


def _other(entry: StateEntry, offload: bool) -> object:
    if entry.kind is EntryKind.IGNORED:
        value = _ignored(entry).detach().clone()
        return value.cpu() if offload else value
    if entry.kind is EntryKind.BUFFER:
        buf = _buffer(entry).detach().clone()
        if entry.dtype is not None and buf.dtype != entry.dtype:
            buf = buf.to(entry.dtype)
        return buf.cpu() if offload else buf
    return entry.module.get_extra_state()


def full_state_dict(
    handles: Sequence[FlatParamHandle], entries: Sequence[StateEntry], settings: StateDictSettings, rank: int
) -> dict[str, Any]:
    """Every entry's full value (a collective: every rank calls it, in the same order)."""
    values: dict[str, torch.Tensor] = {}
    for h in handles:
        values.update(h.full_values())
    if settings.rank0_only and rank != 0:
        return {}
    out: dict[str, Any] = {}
    for e in entries:
        if e.kind is EntryKind.PARAM:
            v = values[e.param]
            out[e.key] = v.cpu() if settings.offload_to_cpu else v
        else:
            out[e.key] = _other(e, settings.offload_to_cpu)
    return out


def sharded_state_dict(
    handles: Sequence[FlatParamHandle], entries: Sequence[StateEntry], settings: StateDictSettings, mesh: DeviceMesh
) -> dict[str, Any]:
    """Parameters as ``DTensor`` s sharded on dim 0 over ``mesh`` (the shard group; replicated
    for ``NO_SHARD``), the rest as in the full state dict. Cuts each parameter from the unit's
    all-gathered flat value, as FSDP1 does."""
    dtensors: dict[str, DTensor] = {}
    for h in handles:
        for name, full in h.full_values().items():
            placement = Shard(0) if h.is_sharded and full.dim() > 0 else Replicate()
            d = distribute_tensor(full, mesh, [placement], src_data_rank=None)
            if settings.offload_to_cpu:
                local = d.to_local().cpu()
                d = DTensor.from_local(
                    local, mesh, [placement], run_check=False, shape=full.shape, stride=full.stride()
                )
            dtensors[name] = d
    out: dict[str, Any] = {}
    for e in entries:
        out[e.key] = dtensors[e.param] if e.kind is EntryKind.PARAM else _other(e, settings.offload_to_cpu)
    return out


def load_state_dict(
    handles: Sequence[FlatParamHandle], entries: Sequence[StateEntry], state_dict: Mapping[str, object], *, strict: bool
) -> _IncompatibleKeys:
    """Load full tensors or ``DTensor`` s (gathered here) under the unwrapped module's keys;
    ``strict`` as ``nn.Module.load_state_dict``. Checked before anything is changed: a value
    that is not a tensor, a shape that differs, a floating-point value for an integer entry or
    the reverse."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
    expected = [e.key for e in entries]
    known = set(expected)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in known]
    if strict and (missing or unexpected):
        raise RuntimeError(_strict_message(missing, unexpected))
    shapes = {p.name: p.shape for h in handles for p in h.layout.params}
    dtypes = {p.name: h.orig_dtype for h in handles for p in h.layout.params}
    for e in entries:
        if e.key not in state_dict or e.kind is EntryKind.EXTRA:
            continue
        value = state_dict[e.key]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{e.key!r}]: expected a tensor, got {type(value).__name__}")
        if e.kind is EntryKind.PARAM:
            shape, dtype = shapes[e.param], dtypes[e.param]
        else:
            own = _ignored(e) if e.kind is EntryKind.IGNORED else _buffer(e)
            shape, dtype = tuple(own.shape), own.dtype
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"state_dict[{e.key!r}]: shape {tuple(value.shape)}, expected {tuple(shape)}")
        if value.dtype.is_floating_point != dtype.is_floating_point or value.dtype.is_complex != dtype.is_complex:
            raise TypeError(
                f"state_dict[{e.key!r}]: dtype {value.dtype} cannot be loaded into {dtype} "
                "(a cast would change its meaning)"
            )
    given: dict[str, torch.Tensor] = {}
    for e in entries:
        if e.kind is EntryKind.PARAM and e.key in state_dict and e.param not in given:
            given[e.param] = full_tensor(state_dict[e.key])
    for h in handles:
        names = [p.name for p in h.layout.params]
        if all(n in given for n in names):
            h.load_values(given)
        elif any(n in given for n in names):
            current = h.full_values()
            h.load_values({n: given.get(n, current[n]) for n in names})
    with torch.no_grad():
        for e in entries:
            if e.key not in state_dict:
                continue
            if e.kind is EntryKind.BUFFER:
                _buffer(e).copy_(full_tensor(state_dict[e.key]))
            elif e.kind is EntryKind.IGNORED:
                _ignored(e).copy_(full_tensor(state_dict[e.key]))
            elif e.kind is EntryKind.EXTRA:
                e.module.set_extra_state(state_dict[e.key])
    return _IncompatibleKeys(missing, unexpected)


def full_tensor(value: object) -> torch.Tensor:
    """A state-dict value as a full tensor: a ``DTensor`` gathered (a collective), a tensor as is."""
    assert isinstance(value, torch.Tensor)
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


def _strict_message(missing: list[str], unexpected: list[str]) -> str:
    lines = ["Error(s) in loading state_dict for FullyShardedDataParallel:"]
    if missing:
        lines.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
    if unexpected:
        lines.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    return "\n\t".join(lines)
