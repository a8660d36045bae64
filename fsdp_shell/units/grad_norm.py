"""``clip_grad_norm_`` over every unit: the total gradient norm across all shards, and the clip."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fsdp_shell.runtime.collectives import all_reduce_flat
from fsdp_shell.units.flat_param import FlatParamHandle

__all__ = ["clip_grad_norm"]


def clip_grad_norm(
    handles: Sequence[FlatParamHandle],
    shard_group: dist.ProcessGroup,
    device: torch.device,
    max_norm: float,
    norm_type: float | str = 2.0,
    unsharded: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Scale every gradient the optimizer steps on so their total ``norm_type``-norm across all
    ranks is at most ``max_norm``; returns that total norm (before clipping). ``max_norm=inf``
    clips nothing (the usual way to log the norm). Sharded units' norms are combined over the
    shard group, replicated ones and the ``unsharded`` parameters' (those FSDP leaves alone)
    counted once, as FSDP1 does. ``ValueError`` / ``TypeError`` naming the
    argument for a bad ``max_norm`` or ``norm_type``."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm: expected a number >= 0 (inf: clip nothing), got {max_norm!r}")
    if norm_type == "inf":
        norm_type = float("inf")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"norm_type: expected a number > 0 or inf, got {norm_type!r}")
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"norm_type: expected a number > 0 or inf, got {norm_type!r}")
    p = float(norm_type)
    sharded, replicated = torch.zeros((), device=device), torch.zeros((), device=device)
    grads: list[torch.Tensor] = []
    for h in handles:
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
    own = [q.grad for q in unsharded if q.grad is not None]
    if own:
        grads.extend(own)
        norms = torch.stack([torch.linalg.vector_norm(g.detach().float(), p) for g in own])
        local = torch.linalg.vector_norm(norms, p).to(device)
        if p == float("inf"):
            replicated.copy_(torch.maximum(replicated, local))
        else:
            replicated += local**p
    if p == float("inf"):
        all_reduce_flat(sharded, shard_group, dist.ReduceOp.MAX)
        total = torch.maximum(sharded, replicated)
    else:
        all_reduce_flat(sharded, shard_group)
        total = (sharded + replicated) ** (1.0 / p)
    if math.isinf(max_norm):
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
    return total
