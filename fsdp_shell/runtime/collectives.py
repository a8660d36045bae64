"""The flat-tensor collectives: all-gather and reduce-scatter through the long-standing entry
points, and the reduce-scatter gloo lacks.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single``; torch 2.4 has only the old names, which every
release since accepts. We call the old ones and silence only their deprecation warning,
locally.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["ALL_TO_ALL_MAX_BYTES", "all_gather_flat", "gloo_reduce_scatter", "reduce_scatter_flat"]

_DEPRECATED = r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def all_gather_flat(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """Gather every rank's ``input`` into ``output`` (rank order)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED, category=FutureWarning)
        work: dist.Work | None = dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
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
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED, category=FutureWarning)
        work: dist.Work | None = dist.reduce_scatter_tensor(output, input, op=reduce_op, group=group, async_op=async_op)
    return work


ALL_TO_ALL_MAX_BYTES = 4 << 20
"""Gloo reduce-scatters of inputs up to this size go by all-to-all (fast, one more buffer)."""


def gloo_reduce_scatter(dst: torch.Tensor, src: torch.Tensor, group: dist.ProcessGroup, *,
                        may_overwrite_src: bool) -> Callable[[], None]:
    """A summing reduce-scatter on gloo, which has none of its own (torch emulates it with an
    all-reduce of a copy of ``src``: twice the bytes of a reduce-scatter, one more buffer).

    Up to ``ALL_TO_ALL_MAX_BYTES``, or when ``src`` must survive: an all-to-all (every rank
    sends each other rank its chunk, the bytes of a ring reduce-scatter) into a receive buffer
    and a local sum of the chunks, 4-8x faster than torch's emulation on loopback
    (``benchmarks/bench_collectives.py``). Larger inputs the plan frees right after: an
    in-place all-reduce of ``src`` and a copy of this rank's chunk, which needs no buffer
    beyond ``src`` and ``dst``, as the unsharded gradient dominates memory there."""
    if may_overwrite_src and src.numel() * src.element_size() > ALL_TO_ALL_MAX_BYTES:
        work = dist.all_reduce(src, group=group, async_op=True)
        chunk = src.narrow(0, group.rank() * dst.numel(), dst.numel())

        def land_chunk() -> None:
            work.wait()
            dst.copy_(chunk)

        return land_chunk
    chunks = torch.empty_like(src)
    exchange = dist.all_to_all_single(chunks, src, group=group, async_op=True)

    def land_sum() -> None:
        exchange.wait()
        first, *rest = chunks.view(group.size(), -1)
        if rest:
            torch.add(first, rest[0], out=dst)
            for chunk in rest[1:]:
                dst.add_(chunk)
        else:
            dst.copy_(first)
        assert src.numel()

    return land_sum
