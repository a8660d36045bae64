"""The tensors of a per-parameter (FSDP2, ``fully_shard``) unit, laid out as
``fsdp_core.PerParamLayout`` says: each rank's padded shards, the all-gather's copy-in of them
into the rank's slice of one buffer, and its copy-out back into whole parameters; the
reduce-scatter's copy-in of the unsharded gradients, and the sharded gradients it leaves.

The offsets are the layout's (``chunk_at``, ``padded_sharded_shape``); this module only moves
elements. As in PyTorch's FSDP2, the copy-out is one ``torch.split_with_sizes_copy`` of the
gathered buffer, viewed ``(world, slice)``, into each parameter's padded unsharded tensor, whose
rows past the parameter's own are padding; a parameter sharded on a dimension other than 0 is
gathered as chunks stacked on dimension 0 and concatenated back along its own dimension.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fsdp_core import PerParamLayout

__all__ = [
    "copy_in",
    "copy_in_grads",
    "copy_out",
    "copy_out_into",
    "padded_shard",
    "sharded_grads",
    "unsharded_of",
]


def padded_shard(layout: PerParamLayout, index: int, full: torch.Tensor, rank: int) -> torch.Tensor:
    """``rank``'s padded shard of parameter ``index`` from its whole value ``full``: its
    ``torch.chunk`` along the shard dimension, zeros after its rows (FSDP2's padded sharded
    parameter)."""
    p = layout.params[index]
    if tuple(full.shape) != p.shape:
        raise ValueError(f"full: expected the shape of {p.name!r}, {p.shape}, got {tuple(full.shape)}")
    out = full.new_zeros(layout.padded_sharded_shape(index))
    rows = layout.rows(index, rank)
    if rows:
        start = rank * layout.chunk_rows[index]
        out.narrow(p.shard_dim, 0, rows).copy_(full.narrow(p.shard_dim, start, rows))
    return out


def copy_in(layout: PerParamLayout, shards: Sequence[torch.Tensor], out: torch.Tensor, rank: int) -> torch.Tensor:
    """Copy every parameter's padded shard (``shards``, in parameter order) into ``rank``'s slice
    of ``out``, the all-gather output (``layout.padded_numel`` elements); returns that slice, the
    all-gather's input, so the all-gather runs in place."""
    if len(shards) != len(layout.params):
        raise ValueError(f"shards: expected one per parameter ({len(layout.params)}), got {len(shards)}")
    if out.numel() != layout.padded_numel:
        raise ValueError(f"out: expected {layout.padded_numel} elements (world x slice), got {out.numel()}")
    mine = out.narrow(0, rank * layout.slice_numel, layout.slice_numel)
    torch._foreach_copy_(  # one kernel launch for the unit, as FSDP2's copy-in
        list(torch.split(mine, list(layout.padded_shard_numel))), [s.reshape(-1) for s in shards]
    )
    return mine


def copy_out(layout: PerParamLayout, gathered: torch.Tensor) -> list[torch.Tensor]:
    """Every parameter's whole value from the gathered buffer, in parameter order: tensors of the
    parameters' shapes, copied out into new buffers (``copy_out_into``)."""
    stacked = [gathered.new_empty(layout.gathered_shape(i)) for i in range(len(layout.params))]
    copy_out_into(layout, gathered, stacked)
    return [unsharded_of(layout, i, t) for i, t in enumerate(stacked)]


def copy_out_into(layout: PerParamLayout, gathered: torch.Tensor, stacked: Sequence[torch.Tensor]) -> None:
    """Copy every parameter's ``world`` padded chunks out of the gathered buffer into ``stacked``
    (one tensor per parameter, of ``layout.gathered_shape``), in one
    ``torch.split_with_sizes_copy`` as FSDP2's copy-out."""
    world = layout.world
    if gathered.numel() != layout.padded_numel:
        raise ValueError(f"gathered: expected {layout.padded_numel} elements (world x slice), got {gathered.numel()}")
    torch.split_with_sizes_copy(
        gathered.view(world, -1), list(layout.padded_shard_numel), dim=1, out=[t.view(world, -1) for t in stacked]
    )


def unsharded_of(layout: PerParamLayout, index: int, stacked: torch.Tensor) -> torch.Tensor:
    """Parameter ``index``'s whole value from its stacked chunks: for a parameter sharded on
    dimension 0 a view of them without the padding rows; for another dimension the chunks
    concatenated along it (a new tensor, as in FSDP2)."""
    p = layout.params[index]
    whole = stacked if p.shard_dim == 0 else torch.cat(stacked.chunk(layout.world, dim=0), dim=p.shard_dim)
    return whole.narrow(p.shard_dim, 0, p.rows)


def copy_in_grads(layout: PerParamLayout, grads: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """The reduce-scatter's input: every parameter's unsharded gradient (its shape, in
    parameter order) padded on its shard dimension to ``world`` chunks, chunk ``r`` copied to
    ``chunk_at(i, r)`` of ``out`` and cast to ``out``'s dtype, in one ``torch._chunk_cat``, as
    FSDP2's copy-in (a gradient sharded on another dimension is first stacked as its chunks on
    dimension 0)."""
    if len(grads) != len(layout.params):
        raise ValueError(f"grads: expected one per parameter ({len(layout.params)}), got {len(grads)}")
    if out.numel() != layout.padded_numel:
        raise ValueError(f"out: expected {layout.padded_numel} elements (world x slice), got {out.numel()}")
    world = layout.world
    stacked = []
    for p, g in zip(layout.params, grads):
        if tuple(g.shape) != p.shape:
            raise ValueError(f"grads: expected the shape of {p.name!r}, {p.shape}, got {tuple(g.shape)}")
        stacked.append(g if p.shard_dim == 0 else torch.cat(torch.chunk(g, world, dim=p.shard_dim), dim=0))
    torch._chunk_cat(stacked, 0, world, out=out.view(world, -1))


def sharded_grads(layout: PerParamLayout, reduced: torch.Tensor, rank: int) -> list[torch.Tensor]:
    """Every parameter's sharded gradient on ``rank``, as views of the reduce-scatter's output
    ``reduced`` (one rank's slice): its rows at its offset, in its sharded shape (FSDP2's
    ``.grad`` local tensors; empty where ``rank`` holds no rows)."""
    if reduced.numel() != layout.slice_numel:
        raise ValueError(f"reduced: expected {layout.slice_numel} elements (one rank's slice), got {reduced.numel()}")
    out = []
    for i, p in enumerate(layout.params):
        numel = layout.rows(i, rank) * p.row_numel
        out.append(reduced.narrow(0, layout.shard_offsets[i], numel).view(layout.sharded_shape(i, rank)))
    return out
