"""Sharded checkpoints with ``torch.distributed.checkpoint``, resumable on another world size.

Only the public API: inside ``FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)``
the model's ``state_dict()`` and ``FSDP.optim_state_dict`` hold DTensors under the original
parameter names (``fully_shard``'s: ``torch.distributed.checkpoint.state_dict``'s
``get_model_state_dict`` and ``get_optimizer_state_dict``), so every rank writes only its shard
and DCP reshards on load when the number of ranks differs. ``meta.json`` records what must match
for a resume: the model's entries and their shapes. Saving and loading go through
``fsdp_shell.state.checkpoint`` (versions made current atomically, files checked against a
manifest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdp_shell.fsdp import FullyShardedDataParallel
from fsdp_shell.state import checkpoint
from fsdp_shell.state.state_dict import StateDictType

__all__ = ["CheckpointMismatch", "load_checkpoint", "read_meta", "save_checkpoint"]

CheckpointError = checkpoint.CheckpointError


class CheckpointMismatch(ValueError):
    """The checkpoint was written for a different model or layout."""


def _ensure_state(opt: torch.optim.Optimizer) -> None:
    """AdamW's state before its first step, so a template exists for DCP to load into."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p not in opt.state or not opt.state[p]:
                opt.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    _ensure_state(opt)
    if not isinstance(model, FullyShardedDataParallel):  # fully_shard: DTensor parameters already
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return {"model": model.state_dict(), "optim": FullyShardedDataParallel.optim_state_dict(model, opt)}


def layout_signature(state: dict[str, Any]) -> list[list[object]]:
    """The model's state-dict entries and their (global) shapes: what a resume must match."""
    return [[name, list(value.shape)] for name, value in state["model"].items()]


def save_checkpoint(directory: Path, model: nn.Module, opt: torch.optim.Optimizer, meta: dict[str, object]) -> None:
    """Write a new version of ``directory`` (collective) and make it current only when complete
    (``fsdp_shell.state.checkpoint``): a run killed while saving leaves the previous checkpoint."""
    state = _state(model, opt)
    checkpoint.save_checkpoint(directory, state, dict(meta, layout=layout_signature(state)))


def read_meta(directory: Path) -> dict[str, object]:
    """The current checkpoint's metadata, after checking every file against the manifest;
    ``CheckpointError`` (one line) when the directory holds no intact checkpoint."""
    return checkpoint.read_meta(directory)


def load_checkpoint(directory: Path, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    """Verify and load the current checkpoint (resharding to this world) into the model and
    optimizer; returns its metadata."""
    state = _state(model, opt)
    meta = checkpoint.load_checkpoint(directory, state)
    if meta.get("layout") != json.loads(json.dumps(layout_signature(state))):
        raise CheckpointMismatch(f"--resume: {directory} was saved from a different model")
    if not isinstance(model, FullyShardedDataParallel):
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        return meta
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(state["model"])
        FullyShardedDataParallel.optim_state_dict_to_load(model, opt, state["optim"], load_directly=True)
    return meta
