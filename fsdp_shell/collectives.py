"""The two flat-tensor collectives under the names this torch prefers.

torch 2.13 renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to
``all_gather_single``/``reduce_scatter_single`` and warns on the old names; older releases
have only the old ones.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat"]

_all_gather: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """Gather every rank's ``input`` into ``output`` (rank order)."""
    work: dist.Work | None = _all_gather(output, input, group=group, async_op=async_op)
    return work


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce ``input`` across ranks and leave this rank's chunk in ``output``."""
    reduce_op = dist.ReduceOp.SUM if op is None else op
    work: dist.Work | None = _reduce_scatter(output, input, op=reduce_op, group=group, async_op=async_op)
    return work
