"""Optimizer state dicts under the original parameter names, full or sharded, as FSDP1's
``FSDP.optim_state_dict`` / ``FSDP.optim_state_dict_to_load``.

The optimizer steps flat sharded parameters (or, with ``use_orig_params``, 1-D sharded views
of the originals), so its per-element state (``exp_avg``, ``momentum_buffer``...) is sharded
like them. ``optim_state_dict`` all-gathers each unit's state over the shard group and cuts it
into the original parameters' shapes: ``{"state": {fqn: {key: value}}, "param_groups": [{...,
"params": [fqn, ...]}]}``; under ``SHARDED_STATE_DICT`` every per-element value is a ``DTensor``
sharded on dim 0, as the parameters are, so ``torch.distributed.checkpoint`` saves and loads it
at any world size. Per-parameter scalars (``step``) are kept as they are.
``optim_state_dict_to_load`` is the inverse: a state dict for ``optimizer.load_state_dict``.

Per-element state is told from scalars by shape: a tensor shaped like its (sharded) parameter.
Every function is a collective over the shard group: every rank calls it, in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fsdp_shell.state.state_dict import StateDictSettings, StateDictType, full_tensor
from fsdp_shell.units.flat_param import FlatParamHandle

__all__ = ["optim_state_dict", "optim_state_dict_to_load", "param_group_names"]


@dataclass(frozen=True, slots=True, eq=False)
class _Slot:
    """One tensor the optimizer steps: a unit's flat parameter (``indices``: all its originals)
    or one original parameter's sharded view (``indices``: that one)."""

    param: torch.Tensor
    handle: FlatParamHandle
    indices: tuple[int, ...]

    @property
    def names(self) -> list[str]:
        return [self.handle.layout.params[i].name for i in self.indices]


def _slots(handles: Sequence[FlatParamHandle]) -> list[_Slot]:
    out: list[_Slot] = []
    for h in handles:
        if h.use_orig_params:
            out.extend(_Slot(p, h, (i,)) for i, p in enumerate(h.orig_params))
        else:
            out.append(_Slot(h.flat_param, h, tuple(range(len(h.layout.params)))))
    return out


Ignored = Sequence[tuple[str, torch.Tensor]]
"""The parameters FSDP leaves alone, with their names: their optimizer state is kept as it is."""


def _by_param(
    handles: Sequence[FlatParamHandle], optim: torch.optim.Optimizer, ignored: Ignored = ()
) -> dict[int, _Slot]:
    slots = {id(s.param): s for s in _slots(handles)}
    left_alone = {id(p) for _, p in ignored}
    for group in optim.param_groups:
        for p in group["params"]:
            if id(p) not in slots and id(p) not in left_alone:
                raise ValueError("optim: steps a parameter that is not one of this FSDP model's parameters()")
    return slots


def _is_elementwise(value: object, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _local_flat(
    slots: list[_Slot], state: Mapping[torch.Tensor, Mapping[str, object]], key: str, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's shard of one unit's state ``key``, as a flat tensor (zeros where none)."""
    h = slots[0].handle
    flat = torch.zeros(h.shard_numel, dtype=dtype, device=h.device)
    for s in slots:
        value = state.get(s.param, {}).get(key)
        if not isinstance(value, torch.Tensor) or not _is_elementwise(value, s.param):
            continue
        if not h.use_orig_params:
            flat.copy_(value.reshape(-1))
            continue
        view = h.shard_view(s.indices[0])
        if view is not None:
            flat[view.offset_in_buffer : view.offset_in_buffer + view.numel].copy_(value.reshape(-1))
    return flat


def _holds_none(slot: _Slot) -> bool:
    """Whether this rank holds none of the slot's parameter: its scalars (``step``) are not the
    parameter's (an optimizer never steps an empty view; only a template gives it state)."""
    return slot.handle.use_orig_params and slot.handle.shard_view(slot.indices[0]) is None


def optim_state_dict(
    handles: Sequence[FlatParamHandle],
    optim: torch.optim.Optimizer,
    settings: StateDictSettings,
    mesh: DeviceMesh,
    rank: int,
    ignored: Ignored = (),
) -> dict[str, Any]:
    """The optimizer's state by original parameter name, full or (``SHARDED_STATE_DICT``) as
    DTensors (``handles``: every unit's flat parameter that has one); the ``ignored``
    parameters' state as it is on this rank."""
    groups_names = param_group_names(handles, optim, ignored)
    state: Mapping[torch.Tensor, Mapping[str, object]] = optim.state
    per_unit: dict[int, list[_Slot]] = {}
    for s in _slots(handles):
        per_unit.setdefault(id(s.handle), []).append(s)
    local_keys: dict[int, dict[str, str]] = {}
    scalars: dict[str, dict[str, object]] = {}
    for unit_id, slots in per_unit.items():
        for s in slots:
            for key, value in state.get(s.param, {}).items():
                if _is_elementwise(value, s.param):
                    assert isinstance(value, torch.Tensor)
                    local_keys.setdefault(unit_id, {})[key] = str(value.dtype).removeprefix("torch.")
                elif not _holds_none(s):
                    for name in s.names:
                        scalars.setdefault(name, {})[key] = value
    order = list(per_unit)
    payload = ({order.index(u): keys for u, keys in local_keys.items()}, scalars)
    shard_group = handles[0].shard_group
    everyone: list[Any] = [None] * dist.get_world_size(shard_group)
    dist.all_gather_object(everyone, payload, group=shard_group)
    unit_keys: dict[int, dict[str, str]] = {}
    all_scalars: dict[str, dict[str, object]] = {}
    for keys, found in everyone:
        for index, kinds in keys.items():
            unit_keys.setdefault(index, {}).update(kinds)
        for name, values in found.items():
            for key, value in values.items():
                all_scalars.setdefault(name, {}).setdefault(key, value)
    out_state: dict[str, dict[str, object]] = {}
    for index, unit_id in enumerate(order):
        slots = per_unit[unit_id]
        h = slots[0].handle
        for key, dtype_name in sorted(unit_keys.get(index, {}).items()):
            full = h.gather_full(_local_flat(slots, state, key, getattr(torch, dtype_name)))
            for i, spec in enumerate(h.layout.params):
                start, end = h.layout.param_range(i)
                value = full[start:end].view(spec.shape).clone()
                out_state.setdefault(spec.name, {})[key] = _present(value, settings, mesh, h.is_sharded)
        for spec in h.layout.params:
            for key, value in all_scalars.get(spec.name, {}).items():
                out_state.setdefault(spec.name, {})[key] = value
    for name, p in ignored:
        for key, value in state.get(p, {}).items():
            kept = value.detach().clone() if isinstance(value, torch.Tensor) else value
            if isinstance(kept, torch.Tensor) and settings.offload_to_cpu:
                kept = kept.cpu()
            out_state.setdefault(name, {})[key] = kept
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": names}
        for group, names in zip(optim.param_groups, groups_names)
    ]
    if settings.kind is StateDictType.FULL_STATE_DICT and settings.rank0_only and rank != 0:
        return {}
    return {"state": out_state, "param_groups": groups}


def param_group_names(
    handles: Sequence[FlatParamHandle], optim: torch.optim.Optimizer, ignored: Ignored = ()
) -> list[list[str]]:
    """The original parameter names of each of ``optim``'s groups, as ``optim_state_dict``
    gives them (no collective)."""
    by_param = _by_param(handles, optim, ignored)
    own = {id(p): name for name, p in ignored}
    return [
        [n for p in group["params"] for n in (by_param[id(p)].names if id(p) in by_param else [own[id(p)]])]
        for group in optim.param_groups
    ]


def _present(value: torch.Tensor, settings: StateDictSettings, mesh: DeviceMesh, sharded: bool) -> object:
    if settings.kind is StateDictType.FULL_STATE_DICT:
        return value.cpu() if settings.offload_to_cpu else value
    placement = Shard(0) if sharded and value.dim() > 0 else Replicate()
    return distribute_tensor(value, mesh, [placement], src_data_rank=None)


def optim_state_dict_to_load(
    handles: Sequence[FlatParamHandle],
    optim: torch.optim.Optimizer,
    optim_state_dict: Mapping[str, Any],
    ignored: Ignored = (),
) -> dict[str, Any]:
    """``optim_state_dict`` (full tensors or DTensors by original name) as the state dict
    ``optim.load_state_dict`` takes: this rank's shards, numbered as ``optim.state_dict()``;
    the ``ignored`` parameters' state as saved."""
    if not isinstance(optim_state_dict, Mapping) or not {"state", "param_groups"} <= set(optim_state_dict):
        raise TypeError(
            "optim_state_dict: expected a mapping with 'state' and 'param_groups', as FSDP.optim_state_dict returns"
        )
    by_param = _by_param(handles, optim, ignored)
    own = {id(p): name for name, p in ignored}
    saved: Mapping[str, Mapping[str, object]] = optim_state_dict["state"]
    saved_groups = optim_state_dict["param_groups"]
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(
            f"optim_state_dict: {len(saved_groups)} parameter groups, the optimizer has {len(optim.param_groups)}"
        )
    current = optim.state_dict()
    out_state: dict[int, dict[str, object]] = {}
    number = 0
    gathered: dict[tuple[str, str], torch.Tensor] = {}
    for group in optim.param_groups:
        for p in group["params"]:
            if id(p) in own:
                out_state[number] = {
                    k: full_tensor(v).clone().to(p.device) if isinstance(v, torch.Tensor) else v
                    for k, v in saved.get(own[id(p)], {}).items()
                }
            else:
                out_state[number] = _load_slot(by_param[id(p)], saved, gathered)
            if not out_state[number]:
                del out_state[number]
            number += 1
    groups = []
    for mine, theirs in zip(current["param_groups"], saved_groups):
        groups.append({**{k: v for k, v in theirs.items() if k != "params"}, "params": mine["params"]})
    return {"state": out_state, "param_groups": groups}


def _load_slot(
    slot: _Slot, saved: Mapping[str, Mapping[str, object]], gathered: dict[tuple[str, str], torch.Tensor]
) -> dict[str, object]:
    """One optimizer parameter's state from the saved full values (``gathered``: the full
    values of DTensors gathered so far, each gathered once)."""
    h = slot.handle
    shapes = {spec.name: spec.shape for spec in h.layout.params}
    mine = slot.names
    keys = sorted({k for n in shapes for k in saved.get(n, {})})
    out: dict[str, object] = {}
    for key in keys:
        values = {n: saved.get(n, {}).get(key) for n in shapes}
        shaped = [
            n for n, v in values.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == shapes[n]
        ]
        if not shaped:
            first = next((values[n] for n in mine if values[n] is not None), None)
            if first is not None:
                out[key] = first.clone() if isinstance(first, torch.Tensor) else first
            continue
        fulls = {}
        for n in shaped:
            if (n, key) not in gathered:
                gathered[(n, key)] = full_tensor(values[n])
            fulls[n] = gathered[(n, key)]
        local = h.shard_of(fulls, fulls[shaped[0]].dtype)
        if not h.use_orig_params:
            out[key] = local.clone().to(slot.param.device)
            continue
        view = h.shard_view(slot.indices[0])
        if view is None:
            out[key] = torch.zeros_like(slot.param)
        else:
            piece = local[view.offset_in_buffer : view.offset_in_buffer + view.numel]
            out[key] = piece.reshape(slot.param.shape).clone().to(slot.param.device)
    return out
