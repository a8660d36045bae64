"""Communication volume derived from a plan.

Per collective and per rank, with the ring algorithms NCCL and gloo use for large messages:
a reduce-scatter over ``g`` ranks of an input of ``g * c`` elements sends (and receives)
``(g - 1) * c`` elements; an all-reduce of ``n`` elements is a reduce-scatter followed by an
all-gather of ``ceil(n / g)``-element chunks, ``2 * (g - 1) * ceil(n / g)`` elements. A group of
one rank sends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_core.config import CommHook
from fsdp_core.layout import ceil_div
from fsdp_core.ops import AllReduce, CommHookCall, Group, Op, ReduceScatter, op_name
from fsdp_core.plan import Plan

__all__ = ["CommVolume", "comm_volume", "ring_bytes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CommVolume:
    """One collective of a plan and what it moves per rank."""

    op_index: int
    collective: str
    """``reduce_scatter`` or ``all_reduce`` (what a comm hook runs underneath, for hooks)."""
    op: str
    """The plan op: ``reduce_scatter``, ``all_reduce`` or ``comm_hook``."""
    group: Group
    group_size: int
    input_numel: int
    output_numel: int
    dtype: torch.dtype
    """The dtype on the wire."""
    bytes: int
    """Bytes each rank sends (and receives) on the wire."""

    @property
    def input_bytes(self) -> int:
        """Size of the collective's input on each rank."""
        return self.input_numel * self.dtype.itemsize

    @property
    def output_bytes(self) -> int:
        """Size of the collective's output on each rank."""
        return self.output_numel * self.dtype.itemsize


def ring_bytes(collective: str, numel: int, group_size: int, dtype: torch.dtype) -> int:
    """Bytes one rank sends for ``collective`` (``reduce_scatter`` of an ``numel``-element input,
    or ``all_reduce`` of ``numel`` elements) over ``group_size`` ranks."""
    g = group_size
    if g <= 1:
        return 0
    chunk = ceil_div(numel, g)
    if collective == "reduce_scatter":
        return (g - 1) * chunk * dtype.itemsize
    if collective == "all_reduce":
        return 2 * (g - 1) * chunk * dtype.itemsize
    raise ValueError(f"collective: expected reduce_scatter or all_reduce, got {collective!r}")


def comm_volume(plan: Plan) -> tuple[CommVolume, ...]:
    """Every collective ``plan`` issues, in order, with its per-rank volume."""
    sharding = plan.request.sharding
    sizes = {Group.SHARD: sharding.shard_size, Group.REPLICATE: sharding.replicate_size}
    return tuple(
        v for i, op in enumerate(plan.ops) if (v := _volume(i, op, sizes)) is not None
    )


def _volume(index: int, op: Op, sizes: dict[Group, int]) -> CommVolume | None:
    match op:
        case ReduceScatter():
            g = sizes[op.group]
            return CommVolume(op_index=index, collective="reduce_scatter", op=op_name(op), group=op.group,
                              group_size=g, input_numel=op.src.numel, output_numel=op.dst.numel,
                              dtype=op.src.dtype, bytes=ring_bytes("reduce_scatter", op.src.numel, g, op.src.dtype))
        case AllReduce():
            g = sizes[op.group]
            return CommVolume(op_index=index, collective="all_reduce", op=op_name(op), group=op.group,
                              group_size=g, input_numel=op.buffer.numel, output_numel=op.buffer.numel,
                              dtype=op.buffer.dtype, bytes=ring_bytes("all_reduce", op.buffer.numel, g, op.buffer.dtype))
        case CommHookCall():
            g = sizes[op.group]
            in_place = op.src == op.dst or op.hook is CommHook.ALLREDUCE
            collective = "all_reduce" if in_place else "reduce_scatter"
            return CommVolume(op_index=index, collective=collective, op=op_name(op), group=op.group,
                              group_size=g, input_numel=op.src.numel, output_numel=op.dst.numel,
                              dtype=op.wire_dtype, bytes=ring_bytes(collective, op.src.numel, g, op.wire_dtype))
        case _:
            return None
