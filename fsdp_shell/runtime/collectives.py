"""The flat-tensor collectives: all-gather and reduce-scatter through the long-standing entry
points, and the plan's reduce ops as ``torch.distributed``'s.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single``; torch 2.4 has only the old names, which every
release since accepts. We call the old ones and silence only their deprecation warning,
locally.
"""

from __future__ import annotations

import warnings
from typing import assert_never

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _make_nccl_premul_sum

from fsdp_core import ReduceKind, ReduceOpSpec

__all__ = ["all_gather_flat", "any_rank", "reduce_scatter_flat", "release", "to_reduce_op"]

_DEPRECATED = r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def to_reduce_op(spec: ReduceOpSpec) -> dist.ReduceOp:
    """The ``torch.distributed`` reduce op for ``spec``."""
    match spec.kind:
        case ReduceKind.SUM:
            return dist.ReduceOp(dist.ReduceOp.SUM)
        case ReduceKind.AVG:
            return dist.ReduceOp(dist.ReduceOp.AVG)
        case ReduceKind.PREMUL_SUM:
            return _make_nccl_premul_sum(spec.premul)
        case _:
            assert_never(spec.kind)


def all_gather_flat(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """Gather every rank's ``input`` into ``output`` (rank order)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED, category=FutureWarning)
        work: dist.Work | None = dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
    return work


def any_rank(flag: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank of ``group`` (a collective: every rank calls it)."""
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    agreed = bool(t.item())
    release(t)
    return agreed


def release(*tensors: torch.Tensor) -> None:
    """Give back the memory of host tensors a completed collective used and nothing else will:
    gloo's threads may still hold them for a moment after the collective has completed, so
    dropping the last reference here would free them at a time that depends on those threads."""
    for t in tensors:
        storage = t.untyped_storage()
        if t.device.type == "cpu" and storage.size() != 0:
            storage.resize_(0)


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce ``input`` across ranks and leave this rank's chunk in ``output``."""
    reduce_op = dist.ReduceOp.SUM if op is None else op
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED, category=FutureWarning)
        work: dist.Work | None = dist.reduce_scatter_tensor(output, input, op=reduce_op, group=group, async_op=async_op)
    return work
