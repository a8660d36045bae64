"""Where every element of a per-parameter (FSDP2, ``fully_shard``) unit lives: each parameter
sharded on its own, and the rank-major buffers its collectives run on.

FSDP2 shards each parameter of a unit along one dimension (``Shard(dim)``, dim 0 unless a
``shard_placement_fn`` says otherwise) as ``torch.chunk`` does: every rank's chunk has
``ceil(size / world)`` rows along that dimension, the last ranks' fewer or none. Each rank keeps
its chunk padded to the full chunk (zeros after its rows), so every rank's padded shard of a
parameter has the same number of elements. A unit's collectives run on one flat buffer per rank:
the parameters' padded shards end to end, in parameter order (one rank's *slice*). The
all-gather output and the reduce-scatter input are ``world`` slices, rank-major: rank ``r``'s
chunk of parameter ``i`` lies at ``r * slice_numel + shard_offsets[i]``. The reduce-scatter's
copy-in pads each unsharded gradient on its shard dimension to ``world`` full chunks and copies
chunk ``r`` there (PyTorch's ``chunk_cat``); the all-gather's copy-out reads chunk ``r`` of each
parameter back from the same place and keeps the parameter's own rows.

Sharding on a dimension other than 0 needs that dimension to divide evenly, as in PyTorch's
FSDP2 (uneven sharding there would need copies before and after the collectives). Scalar
parameters are refused, as FSDP2 refuses them.

All arithmetic on per-parameter chunks, padding and offsets is here and nowhere else; the flat
layout of the FSDP1 API is ``fsdp_core.spec.layout``'s, and neither assumes the other (they share
``ceil_div`` and the check of a unit's parameters, ``check_unit_params``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fsdp_core.spec.config import FLOAT_DTYPES
from fsdp_core.spec.layout import ShardView, ceil_div, check_unit_params

__all__ = ["PerParamLayout", "ShardedParam", "UnitDtypes", "unit_dtypes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardedParam:
    """One parameter of a per-parameter unit and the dimension it is sharded on."""

    name: str
    """Fully qualified name under the module ``fully_shard`` was applied to."""
    shape: tuple[int, ...]
    """Its unsharded shape."""
    shard_dim: int = 0
    """The dimension it is chunked along (``Shard(shard_dim)``), non-negative."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"params: every parameter needs a non-empty name, got {self.name!r}")
        if not isinstance(self.shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in self.shape):
            raise ValueError(f"params[{self.name!r}].shape: expected a tuple of non-negative ints, got {self.shape!r}")
        if not self.shape:
            raise ValueError(
                f"params[{self.name!r}]: a scalar parameter cannot be sharded (as in PyTorch's fully_shard); "
                "make it a 1-D tensor of one element"
            )
        if not isinstance(self.shard_dim, int) or not 0 <= self.shard_dim < len(self.shape):
            raise ValueError(
                f"params[{self.name!r}].shard_dim: expected 0 <= shard_dim < {len(self.shape)} "
                f"(its number of dimensions), got {self.shard_dim!r}"
            )

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """Its size along the shard dimension."""
        return self.shape[self.shard_dim]

    @property
    def row_numel(self) -> int:
        """Elements per row along the shard dimension (the product of the other dimensions)."""
        return math.prod(size for d, size in enumerate(self.shape) if d != self.shard_dim)


@dataclass(frozen=True, slots=True, kw_only=True)
class PerParamLayout:
    """The parameters of one per-parameter unit, sharded over a shard group of ``world`` ranks
    (module docstring). ``chunk_rows[i]``, ``padded_shard_numel[i]`` and ``shard_offsets[i]`` are
    derived: parameter ``i``'s rows per rank, its padded shard's elements, and where that shard
    starts in a rank's slice; ``slice_numel`` is one rank's slice."""

    params: tuple[ShardedParam, ...]
    dtype: torch.dtype
    """The parameters' original dtype (one per unit, as in PyTorch's FSDP2)."""
    world: int
    """Ranks in the shard group."""
    chunk_rows: tuple[int, ...] = ()
    padded_shard_numel: tuple[int, ...] = ()
    shard_offsets: tuple[int, ...] = ()
    slice_numel: int = 0

    def __post_init__(self) -> None:
        check_unit_params(self.params, ShardedParam, self.dtype)
        if not isinstance(self.world, int) or isinstance(self.world, bool) or self.world < 1:
            raise ValueError(f"world: expected an int >= 1 (ranks in the shard group), got {self.world!r}")
        for p in self.params:
            if p.shard_dim != 0 and p.rows % self.world:
                raise ValueError(
                    f"params[{p.name!r}]: dimension {p.shard_dim} of size {p.rows} does not divide over "
                    f"{self.world} ranks; only dimension 0 may shard unevenly (as in PyTorch's fully_shard)"
                )
        chunks = tuple(ceil_div(p.rows, self.world) for p in self.params)
        padded = tuple(c * p.row_numel for c, p in zip(chunks, self.params))
        offsets = tuple(sum(padded[:i]) for i in range(len(padded)))
        derived = {
            "chunk_rows": chunks,
            "padded_shard_numel": padded,
            "shard_offsets": offsets,
            "slice_numel": sum(padded),
        }
        for name, value in derived.items():
            given = getattr(self, name)
            if given and given != value:
                raise ValueError(f"{name}: {given} disagrees with the layout {value}")
            object.__setattr__(self, name, value)

    @classmethod
    def of(
        cls,
        params: Iterable[tuple[str, tuple[int, ...]] | tuple[str, tuple[int, ...], int]],
        dtype: torch.dtype,
        world: int,
    ) -> PerParamLayout:
        """Build a layout from ``(name, shape)`` or ``(name, shape, shard_dim)`` entries."""
        specs = tuple(ShardedParam(name=e[0], shape=tuple(e[1]), shard_dim=e[2] if len(e) > 2 else 0) for e in params)
        return cls(params=specs, dtype=dtype, world=world)

    @property
    def padded_numel(self) -> int:
        """The all-gather output and the reduce-scatter input: ``world`` slices."""
        return self.world * self.slice_numel

    @property
    def total_numel(self) -> int:
        """The elements of the unit's unsharded gradients, laid end to end in parameter order (the
        gradient a plan starts from, as ``FlatParamLayout.total_numel`` is the flat one's)."""
        return sum(p.numel for p in self.params)

    @property
    def numel_without_padding(self) -> int:
        """Sum of the parameters' numels (``total_numel``: the unit adds no alignment padding)."""
        return self.total_numel

    def shard_views(self, rank: int) -> tuple[ShardView, ...]:
        """Where each parameter's shard lies in ``rank``'s slice: one view per parameter ``rank``
        holds rows of (parameters it holds none of are absent). ``offset_in_param`` counts in the
        parameter with its shard dimension's chunks stacked first, as the copy-in reads it, so a
        rank's chunk is contiguous there for every shard dimension."""
        out: list[ShardView] = []
        for i, p in enumerate(self.params):
            numel = self.rows(i, rank) * p.row_numel
            if numel:
                start = rank * self.chunk_rows[i] * p.row_numel
                out.append(
                    ShardView(
                        param_index=i,
                        param_name=p.name,
                        offset_in_buffer=self.shard_offsets[i],
                        offset_in_param=start,
                        numel=numel,
                    )
                )
        return tuple(out)

    def unsharded_views(self) -> tuple[ShardView, ...]:
        """Each parameter's whole gradient in the unsharded gradients laid end to end."""
        out: list[ShardView] = []
        offset = 0
        for i, p in enumerate(self.params):
            if p.numel:
                out.append(
                    ShardView(
                        param_index=i, param_name=p.name, offset_in_buffer=offset, offset_in_param=0, numel=p.numel
                    )
                )
            offset += p.numel
        return tuple(out)

    def rows(self, index: int, rank: int) -> int:
        """Rows of parameter ``index`` that ``rank`` holds (``torch.chunk``'s: the last ranks'
        chunks are shorter or empty)."""
        self._check_rank(rank)
        c = self.chunk_rows[index]
        return max(0, min(c, self.params[index].rows - rank * c))

    def sharded_shape(self, index: int, rank: int) -> tuple[int, ...]:
        """The shape of ``rank``'s shard of parameter ``index`` without padding (the local tensor
        of its sharded ``DTensor``)."""
        p = self.params[index]
        d = p.shard_dim
        return (*p.shape[:d], self.rows(index, rank), *p.shape[d + 1 :])

    def padded_sharded_shape(self, index: int) -> tuple[int, ...]:
        """The shape every rank's padded shard of parameter ``index`` has."""
        p = self.params[index]
        d = p.shard_dim
        return (*p.shape[:d], self.chunk_rows[index], *p.shape[d + 1 :])

    def chunk_at(self, index: int, rank: int) -> tuple[int, int]:
        """``(offset, numel)`` of ``rank``'s padded chunk of parameter ``index`` in the rank-major
        buffers (the all-gather output, the reduce-scatter input)."""
        self._check_rank(rank)
        return rank * self.slice_numel + self.shard_offsets[index], self.padded_shard_numel[index]

    def padded_unsharded_shape(self, index: int) -> tuple[int, ...]:
        """Parameter ``index`` padded on its shard dimension to ``world`` full chunks: the shape
        its gradient takes in the reduce-scatter's copy-in."""
        p = self.params[index]
        d = p.shard_dim
        return (*p.shape[:d], self.world * self.chunk_rows[index], *p.shape[d + 1 :])

    def gathered_shape(self, index: int) -> tuple[int, ...]:
        """The shape parameter ``index`` is copied out of the all-gather in: its ``world`` padded
        shards stacked on dimension 0 (for a parameter sharded on dimension 0, its padded
        unsharded shape)."""
        shape = self.padded_sharded_shape(index)
        return (self.world * shape[0], *shape[1:])

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank: expected 0 <= rank < {self.world}, got {rank!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitDtypes:
    """The dtypes of one per-parameter unit's step, from its parameters' dtype and
    ``MixedPrecisionPolicy`` as PyTorch's FSDP2 resolves them."""

    orig: torch.dtype
    """The sharded parameters', and the sharded gradients' the optimizer sees."""
    compute: torch.dtype
    """The all-gather's and the unsharded parameters' (forward and backward run in it), so the
    unsharded gradients' too."""
    reduce: torch.dtype
    """The reduce-scatter's and all-reduce's, and ``no_sync`` accumulation's."""


def unit_dtypes(orig: torch.dtype, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> UnitDtypes:
    """FSDP2's ``FSDPParam.init_dtype_attrs``: the parameters are gathered and computed in
    ``param_dtype`` (their own dtype when None), gradients are reduced in ``reduce_dtype`` (the
    compute dtype when None; FSDP2 also clamps one equal to ``param_dtype`` to None, which names
    the same dtype), and the reduced shard is cast back to the parameters' dtype."""
    for name, value in (("orig", orig), ("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if value is not None and (not isinstance(value, torch.dtype) or value not in FLOAT_DTYPES):
            raise TypeError(f"{name}: expected a floating dtype{'' if name == 'orig' else ' or None'}, got {value!r}")
    compute = orig if param_dtype is None else param_dtype
    reduce = compute if reduce_dtype is None else reduce_dtype
    return UnitDtypes(orig=orig, compute=compute, reduce=reduce)
