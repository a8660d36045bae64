"""Sharded checkpoints with ``torch.distributed.checkpoint``, resumable on another world size.

Each unit's flat parameter (without padding) and its AdamW moments are saved as DTensors
sharded like the flat parameter (``Shard(0)`` over the shard group, ``Replicate`` over the
replicate group), so every rank writes only its own shard, and DCP reshards on load when the
number of ranks differs. ``meta.json`` records what must match for a resume: the model shape
and every unit's flat layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp_shell.flat_param import FlatParamHandle
from fsdp_shell.fsdp import FullyShardedDataParallel

__all__ = ["CheckpointMismatch", "load_checkpoint", "read_meta", "save_checkpoint"]

MOMENTS = ("exp_avg", "exp_avg_sq")


class CheckpointMismatch(ValueError):
    """The checkpoint was written for a different model or layout."""


def _placements(h: FlatParamHandle, mesh: DeviceMesh) -> list[Placement]:
    inner: Placement = Shard(0) if h.is_sharded else Replicate()
    return [Replicate(), inner] if mesh.ndim == 2 else [inner]


def _dtensor(h: FlatParamHandle, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    total = h.layout.total_numel
    if h.is_sharded:
        b = h.sharding.bounds(h.layout)
        local = local[: b.numel]
    else:
        local = local[:total]
    return DTensor.from_local(local, mesh, _placements(h, mesh), run_check=False,
                              shape=torch.Size([total]), stride=(1,))


def _ensure_state(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            if p not in opt.state or not opt.state[p]:
                opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": torch.zeros_like(p)}


def _flat_moment(model: FullyShardedDataParallel, h: FlatParamHandle, opt: torch.optim.Optimizer,
                 name: str) -> torch.Tensor:
    if not h.use_orig_params:
        moment: torch.Tensor = opt.state[h.flat_param][name]
        return moment
    buf = torch.zeros_like(h.local)
    for view in h.sharding.shard_views(h.layout):
        state = opt.state[h.orig_params[view.param_index]]
        buf[view.offset_in_buffer : view.offset_in_buffer + view.numel].copy_(state[name].reshape(-1))
    return buf


def _scatter_moment(h: FlatParamHandle, opt: torch.optim.Optimizer, name: str, buf: torch.Tensor) -> None:
    if not h.use_orig_params:
        return
    for view in h.sharding.shard_views(h.layout):
        state = opt.state[h.orig_params[view.param_index]]
        state[name].reshape(-1).copy_(buf[view.offset_in_buffer : view.offset_in_buffer + view.numel])


def _state(model: FullyShardedDataParallel, opt: torch.optim.Optimizer, mesh: DeviceMesh
           ) -> tuple[dict[str, DTensor], list[tuple[FlatParamHandle, str, torch.Tensor]]]:
    _ensure_state(opt)
    state: dict[str, DTensor] = {}
    moments: list[tuple[FlatParamHandle, str, torch.Tensor]] = []
    for i, h in enumerate(model.flat_handles()):
        state[f"unit{i}.param"] = _dtensor(h, h.local, mesh)
        for name in MOMENTS:
            buf = _flat_moment(model, h, opt, name)
            moments.append((h, name, buf))
            state[f"unit{i}.{name}"] = _dtensor(h, buf, mesh)
    return state, moments


def layout_signature(model: FullyShardedDataParallel) -> list[list[object]]:
    """Per unit: original parameter names, shapes and the flat numel (what a resume must match)."""
    return [[[p.name, list(p.shape)] for p in h.layout.params] + [h.layout.total_numel] for h in model.flat_handles()]


def save_checkpoint(directory: Path, model: FullyShardedDataParallel, opt: torch.optim.Optimizer,
                    mesh: DeviceMesh, meta: dict[str, object]) -> None:
    """Write every rank's shards to ``directory`` (collective) and ``meta.json`` from rank 0."""
    state, _ = _state(model, opt, mesh)
    dcp_save(state, checkpoint_id=str(directory))
    if dist.get_rank() == 0:
        record = dict(meta, layout=layout_signature(model))
        (directory / "meta.json").write_text(json.dumps(record, indent=2))
    dist.barrier()


def read_meta(directory: Path) -> dict[str, object]:
    """The checkpoint's ``meta.json``; raises ``CheckpointMismatch`` when there is none."""
    path = directory / "meta.json"
    if not path.is_file():
        raise CheckpointMismatch(f"--resume: {directory} holds no fsdp-demo checkpoint (no meta.json)")
    meta: dict[str, object] = json.loads(path.read_text())
    return meta


def load_checkpoint(directory: Path, model: FullyShardedDataParallel, opt: torch.optim.Optimizer,
                    mesh: DeviceMesh) -> dict[str, object]:
    """Load the shards (resharding to this world) into the model and optimizer; returns the meta."""
    meta = read_meta(directory)
    if meta.get("layout") != json.loads(json.dumps(layout_signature(model))):
        raise CheckpointMismatch(f"--resume: {directory} was saved from a different model or flat layout")
    state, moments = _state(model, opt, mesh)
    dcp_load(state, checkpoint_id=str(directory))
    step = float(meta["step"])  # type: ignore[arg-type]  # written by save_checkpoint as a number
    for h, name, buf in moments:
        _scatter_moment(h, opt, name, buf)
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p]["step"] = torch.tensor(step)
    return meta
