"""Communication volume derived from a plan.

Per collective and per rank, with the ring algorithms NCCL and gloo use for large messages:
a reduce-scatter over ``g`` ranks of an input of ``g * c`` elements sends (and receives)
``(g - 1) * c`` elements; an all-reduce of ``n`` elements is a reduce-scatter followed by an
all-gather of ``ceil(n / g)``-element chunks, ``2 * (g - 1) * ceil(n / g)`` elements; an
all-gather into ``n`` elements sends ``(g - 1) * ceil(n / g)``. A group of one rank sends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

import torch

from fsdp_core.plan.ops import (
    Accumulate,
    AllReduce,
    AllReduceHookCall,
    Cast,
    CommHookCall,
    CopyIn,
    Divide,
    EndOfBackwardWait,
    Free,
    FreeUnshardedParam,
    GradViews,
    Group,
    HandOff,
    Input,
    Offload,
    Op,
    Pad,
    RecordStream,
    ReduceScatter,
    WaitStream,
    op_name,
)
from fsdp_core.plan.request import Plan, PlanRequest
from fsdp_core.spec.config import CommHook
from fsdp_core.spec.layout import ceil_div

__all__ = ["CommVolume", "all_gather_volume", "comm_volume", "ring_bytes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CommVolume:
    """One collective of a plan and what it moves per rank."""

    op_index: int
    """The plan op's index; -1 for the parameter all-gather, which is no plan op."""
    collective: str
    """``reduce_scatter``, ``all_reduce`` (what a comm hook runs underneath, for hooks) or ``all_gather``."""
    op: str
    """The plan op: ``reduce_scatter``, ``all_reduce`` or ``comm_hook``; ``all_gather`` for the
    parameter all-gather."""
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
    ``all_reduce`` of ``numel`` elements, or ``all_gather`` into ``numel`` elements) over
    ``group_size`` ranks."""
    g = group_size
    if g <= 1:
        return 0
    chunk = ceil_div(numel, g)
    if collective in ("reduce_scatter", "all_gather"):
        return (g - 1) * chunk * dtype.itemsize
    if collective == "all_reduce":
        return 2 * (g - 1) * chunk * dtype.itemsize
    raise ValueError(f"collective: expected reduce_scatter, all_reduce or all_gather, got {collective!r}")


def all_gather_volume(request: PlanRequest, ranks: int | None = None) -> CommVolume | None:
    """The all-gather that unshards the flat parameter of ``request`` (forward, or backward after
    a reshard): every rank's padded shard in the compute dtype, over the shard group, or over a
    group of ``ranks`` of them (a unit resharded to such groups after forward, ``fully_shard``'s
    hpZ: each holds 1/``ranks`` of it). None for ``NO_SHARD``, whose parameter is never sharded."""
    sharding = request.sharding
    if not sharding.strategy.is_sharded:
        return None
    g = sharding.shard_size if ranks is None else ranks
    padded = request.padded_numel
    dtype = request.compute_dtype
    return CommVolume(
        op_index=-1,
        collective="all_gather",
        op="all_gather",
        group=Group.SHARD,
        group_size=g,
        input_numel=padded // g,
        output_numel=padded,
        dtype=dtype,
        bytes=ring_bytes("all_gather", padded, g, dtype),
    )


def comm_volume(plan: Plan) -> tuple[CommVolume, ...]:
    """Every collective ``plan`` issues, in order, with its per-rank volume."""
    request = plan.request
    return tuple(v for i, op in enumerate(plan.ops) if (v := _volume(i, op, request)) is not None)


def _volume(index: int, op: Op, request: PlanRequest) -> CommVolume | None:
    """The collective ``op`` issues, or None for an op that communicates nothing."""
    match op:
        case ReduceScatter():
            g = request.group_size(op.group)
            return CommVolume(
                op_index=index,
                collective="reduce_scatter",
                op=op_name(op),
                group=op.group,
                group_size=g,
                input_numel=op.src.numel,
                output_numel=op.dst.numel,
                dtype=op.src.dtype,
                bytes=ring_bytes("reduce_scatter", op.src.numel, g, op.src.dtype),
            )
        case AllReduce():
            g = request.group_size(op.group)
            return CommVolume(
                op_index=index,
                collective="all_reduce",
                op=op_name(op),
                group=op.group,
                group_size=g,
                input_numel=op.buffer.numel,
                output_numel=op.buffer.numel,
                dtype=op.buffer.dtype,
                bytes=ring_bytes("all_reduce", op.buffer.numel, g, op.buffer.dtype),
            )
        case CommHookCall():
            g = request.group_size(op.group)
            in_place = op.src == op.dst or op.hook is CommHook.ALLREDUCE
            collective = "all_reduce" if in_place else "reduce_scatter"
            return CommVolume(
                op_index=index,
                collective=collective,
                op=op_name(op),
                group=op.group,
                group_size=g,
                input_numel=op.src.numel,
                output_numel=op.dst.numel,
                dtype=op.wire_dtype,
                bytes=ring_bytes(collective, op.src.numel, g, op.wire_dtype),
            )
        case (
            Input()
            | WaitStream()
            | RecordStream()
            | Free()
            | FreeUnshardedParam()
            | Cast()
            | Pad()
            | CopyIn()
            | Divide()
            | AllReduceHookCall()
            | Accumulate()
            | Offload()
            | GradViews()
            | EndOfBackwardWait()
            | HandOff()
        ):
            return None
        case _:
            assert_never(op)
