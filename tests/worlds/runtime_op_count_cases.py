"""Op counts against FSDP1, measured inside a gloo world: one profiled training step of ours (flat
and ``use_orig_params``) and of FSDP1, every op by name and the full-size fills, adds and copies.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.profiler import ProfilerActivity, profile

from fsdp_shell import FSDP
from tests.worlds.runtime_cases import Layer, batch, make_model, train_step

# -- op counts ------------------------------------------------------------------------------

COUNTED = ("aten::fill_", "aten::zero_", "aten::add_", "aten::add", "aten::slice_backward", "aten::copy_")
"""Ops whose full-size calls we count: what a slice per parameter costs in backward."""


@dataclass
class OpCounts:
    """One profiled training step of one implementation on one rank."""

    names: dict[str, int] = field(default_factory=dict)
    """Every op and autograd node by name: how often it ran."""
    full_size: dict[str, int] = field(default_factory=dict)
    """``COUNTED`` ops on at least a whole unit's flat parameter's worth of elements."""


def _profile_step(model: nn.Module, full_numel: int) -> OpCounts:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(2):
        train_step(model, opt, *batch(step, 16))
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        train_step(model, opt, *batch(2, 16))
    counts = OpCounts()
    names: collections.Counter[str] = collections.Counter()
    full: collections.Counter[str] = collections.Counter()
    for e in prof.events():
        names[e.name] += 1
        shapes = [s for s in e.input_shapes if s]
        if e.name in COUNTED and shapes and _numel(shapes[0]) >= full_numel:
            full[e.name] += 1
    counts.names, counts.full_size = dict(names), dict(full)
    return counts


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def op_counts(rank: int, world: int, arg: None) -> dict[str, OpCounts]:
    """One training step of ours (flat and ``use_orig_params``) and of FSDP1, profiled."""
    torch.set_num_threads(1)
    width, depth = 48, 4
    full_numel = width * width + 3 * width
    out = {}
    for orig in (False, True):
        ours = FSDP(make_model(width, depth), auto_wrap_policy={Layer}, use_orig_params=orig)
        out[f"ours-orig{orig}"] = _profile_step(ours, full_numel)
        theirs = TorchFSDP(
            make_model(width, depth),
            auto_wrap_policy=_torch_policy,
            use_orig_params=orig,
            device_id=torch.device("cpu"),
        )
        out[f"fsdp1-orig{orig}"] = _profile_step(theirs, full_numel)
    return out


def _torch_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, Layer)
