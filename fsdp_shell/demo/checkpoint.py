"""Sharded checkpoints with ``torch.distributed.checkpoint``, resumable on another world size.

Only the public API: inside ``FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)``
the model's ``state_dict()`` and ``FSDP.optim_state_dict`` hold DTensors under the original
parameter names, so every rank writes only its shard and DCP reshards on load when the number
of ranks differs. ``meta.json`` records what must match for a resume: the model's entries and
their shapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from fsdp_shell.fsdp import FullyShardedDataParallel
from fsdp_shell.state_dict import StateDictType

__all__ = ["CheckpointMismatch", "load_checkpoint", "read_meta", "save_checkpoint"]


class CheckpointMismatch(ValueError):
    """The checkpoint was written for a different model or layout."""


def _ensure_state(opt: torch.optim.Optimizer) -> None:
    """AdamW's state before its first step, so a template exists for DCP to load into."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p not in opt.state or not opt.state[p]:
                opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": torch.zeros_like(p)}


def _state(model: FullyShardedDataParallel, opt: torch.optim.Optimizer) -> dict[str, Any]:
    _ensure_state(opt)
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return {"model": model.state_dict(), "optim": FullyShardedDataParallel.optim_state_dict(model, opt)}


def layout_signature(state: dict[str, Any]) -> list[list[object]]:
    """The model's state-dict entries and their (global) shapes: what a resume must match."""
    return [[name, list(value.shape)] for name, value in state["model"].items()]


def save_checkpoint(directory: Path, model: FullyShardedDataParallel, opt: torch.optim.Optimizer,
                    meta: dict[str, object]) -> None:
    """Write every rank's shards to ``directory`` (collective) and ``meta.json`` from rank 0."""
    state = _state(model, opt)
    dcp_save(state, checkpoint_id=str(directory))
    if dist.get_rank() == 0:
        record = dict(meta, layout=layout_signature(state))
        (directory / "meta.json").write_text(json.dumps(record, indent=2))
    dist.barrier()


def read_meta(directory: Path) -> dict[str, object]:
    """The checkpoint's ``meta.json``; raises ``CheckpointMismatch`` when there is none."""
    path = directory / "meta.json"
    if not path.is_file():
        raise CheckpointMismatch(f"--resume: {directory} holds no fsdp-demo checkpoint (no meta.json)")
    meta: dict[str, object] = json.loads(path.read_text())
    return meta


def load_checkpoint(directory: Path, model: FullyShardedDataParallel, opt: torch.optim.Optimizer) -> dict[str, object]:
    """Load the shards (resharding to this world) into the model and optimizer; returns the meta."""
    meta = read_meta(directory)
    state = _state(model, opt)
    if meta.get("layout") != json.loads(json.dumps(layout_signature(state))):
        raise CheckpointMismatch(f"--resume: {directory} was saved from a different model")
    dcp_load(state, checkpoint_id=str(directory))
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(state["model"])
        FullyShardedDataParallel.optim_state_dict_to_load(model, opt, state["optim"], load_directly=True)
    return meta
