"""Where every gradient element lives: the flat parameter's layout, its sharding, shard views.

All arithmetic on offsets, padding and shard bounds is here and nowhere else.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fsdp_core.spec.config import FLOAT_DTYPES, ShardingStrategy

__all__ = [
    "FlatParamLayout",
    "ParamSpec",
    "ShardBounds",
    "ShardView",
    "ShardingSpec",
    "aligned_numel_for",
    "ceil_div",
    "check_unit_params",
]

ALIGNMENT_BYTES = 16
"""FSDP1 aligns each original parameter's start to 16 bytes when ``use_orig_params=True``."""


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ``a`` and positive ``b``, in exact integer arithmetic."""
    return -(-a // b)


def aligned_numel_for(dtype: torch.dtype) -> int:
    """Elements per alignment unit for ``dtype``: FSDP1's ``_get_aligned_numel``."""
    return max(1, ALIGNMENT_BYTES // dtype.itemsize)


def check_unit_params(params: object, kind: type, dtype: object) -> None:
    """One unit's parameters, for either layout: a non-empty tuple of ``kind`` with unique names,
    and one floating ``dtype``; raises naming the field."""
    if not isinstance(params, tuple) or not params:
        raise ValueError(f"params: expected a non-empty tuple of {kind.__name__}")
    if not all(isinstance(p, kind) for p in params):
        raise TypeError(f"params: every entry must be a {kind.__name__}")
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"params: duplicate parameter names {dup}")
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected a floating dtype, got {dtype!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """One original parameter flattened into the flat parameter."""

    name: str
    """Fully qualified name under the wrapped module."""
    shape: tuple[int, ...]
    """Its shape; its numel is the product."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"params: every parameter needs a non-empty name, got {self.name!r}")
        if not isinstance(self.shape, tuple) or not all(isinstance(d, int) for d in self.shape):
            raise TypeError(f"params[{self.name!r}].shape: expected a tuple of ints, got {self.shape!r}")
        if not all(d >= 0 for d in self.shape):
            raise ValueError(f"params[{self.name!r}].shape: expected a tuple of non-negative ints, got {self.shape!r}")

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatParamLayout:
    """The unsharded flat parameter: original parameters laid end to end with alignment padding.

    ``offsets[i]`` is where parameter ``i`` starts. Alignment padding (only when
    ``alignment_numel > 1``) is inserted before a parameter whose start would not be a
    multiple of ``alignment_numel``, as FSDP1 does for ``use_orig_params``. ``total_numel``
    includes alignment padding but not the world-size padding the sharding adds.
    """

    params: tuple[ParamSpec, ...]
    dtype: torch.dtype
    """The parameters' original dtype."""
    alignment_numel: int = 1
    offsets: tuple[int, ...] = ()
    total_numel: int = 0

    def __post_init__(self) -> None:
        check_unit_params(self.params, ParamSpec, self.dtype)
        if not isinstance(self.alignment_numel, int) or self.alignment_numel < 1:
            raise ValueError(f"alignment_numel: expected an int >= 1, got {self.alignment_numel!r}")
        offsets, total = _lay_out(self.params, self.alignment_numel)
        if self.offsets and self.offsets != offsets:
            raise ValueError(f"offsets: {self.offsets} disagree with the layout {offsets}")
        if self.total_numel and self.total_numel != total:
            raise ValueError(f"total_numel: {self.total_numel} disagrees with the layout {total}")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "total_numel", total)
        if total == 0:
            raise ValueError("params: the flat parameter would hold no elements")

    @classmethod
    def of(
        cls,
        params: Iterable[tuple[str, tuple[int, ...]]],
        dtype: torch.dtype,
        *,
        align: bool = False,
        align_dtype: torch.dtype | None = None,
    ) -> FlatParamLayout:
        """Build a layout from ``(name, shape)`` pairs; ``align`` applies FSDP1's 16-byte alignment
        for ``use_orig_params`` in ``align_dtype`` (the compute dtype; default ``dtype``)."""
        specs = tuple(ParamSpec(name=n, shape=tuple(s)) for n, s in params)
        alignment = aligned_numel_for(align_dtype or dtype) if align else 1
        return cls(params=specs, dtype=dtype, alignment_numel=alignment)

    @property
    def numel_without_padding(self) -> int:
        """Sum of the original parameters' numels."""
        return sum(p.numel for p in self.params)

    def param_range(self, index: int) -> tuple[int, int]:
        """``[start, end)`` of parameter ``index`` in the unsharded flat parameter."""
        start = self.offsets[index]
        return start, start + self.params[index].numel


def _lay_out(params: tuple[ParamSpec, ...], alignment: int) -> tuple[tuple[int, ...], int]:
    offsets: list[int] = []
    total = 0
    for p in params:
        total += (-total) % alignment
        offsets.append(total)
        total += p.numel
    return tuple(offsets), total


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardBounds:
    """One rank's shard: ``[start, end)`` of real (unpadded) elements, plus tail padding."""

    rank: int
    start: int
    end: int
    padding: int

    @property
    def numel(self) -> int:
        """Real elements in this shard (the shard's size is ``numel + padding``)."""
        return self.end - self.start


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardView:
    """A slice of one original parameter held in a (sharded or unsharded) gradient buffer."""

    param_index: int
    param_name: str
    offset_in_buffer: int
    """Where the slice starts in the buffer."""
    offset_in_param: int
    """Where the slice starts in the flattened original parameter."""
    numel: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardingSpec:
    """The process-group geometry of one flat parameter, seen from one rank.

    ``shard_size`` is the size of FSDP's process group (the shard group for hybrid strategies;
    for ``NO_SHARD`` the whole data-parallel group, over which nothing is split).
    ``replicate_size`` is the size of the replicate group (1 unless hybrid). ``rank`` is this
    rank's index in the shard group.
    """

    strategy: ShardingStrategy
    shard_size: int
    replicate_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, ShardingStrategy):
            raise TypeError(f"sharding_strategy: expected a ShardingStrategy, got {self.strategy!r}")
        for name in ("shard_size", "replicate_size", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name}: expected an int, got {value!r}")
        if self.shard_size < 1:
            raise ValueError(f"shard_size: expected >= 1, got {self.shard_size}")
        if self.replicate_size < 1:
            raise ValueError(f"replicate_size: expected >= 1, got {self.replicate_size}")
        if not self.strategy.is_hybrid and self.replicate_size != 1:
            raise ValueError(
                f"replicate_size: {self.strategy.name} has no replicate group, so replicate_size "
                f"must be 1 (got {self.replicate_size}); use HYBRID_SHARD or HYBRID_SHARD_ZERO2"
            )
        if not 0 <= self.rank < self.shard_size:
            raise ValueError(f"rank: expected 0 <= rank < shard_size={self.shard_size}, got {self.rank}")

    @classmethod
    def for_world(
        cls, strategy: ShardingStrategy, world_size: int, shard_size: int | None = None, rank: int = 0
    ) -> ShardingSpec:
        """Split a world of ``world_size`` ranks: hybrid strategies into ``world_size / shard_size``
        replicas of ``shard_size`` (default: the whole world, one replica)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
        if shard_size is None:
            shard_size = world_size
        if not isinstance(shard_size, int) or shard_size < 1:
            raise ValueError(f"shard_size: expected an int >= 1, got {shard_size!r}")
        if not strategy.is_hybrid:
            if shard_size != world_size:
                raise ValueError(
                    f"shard_size: only hybrid strategies take a shard size different from the world "
                    f"size ({world_size}); {strategy.name} got {shard_size}"
                )
            return cls(strategy=strategy, shard_size=world_size, rank=rank)
        if world_size % shard_size:
            raise ValueError(f"shard_size: {shard_size} does not divide world_size {world_size}; accepted: a divisor")
        return cls(strategy=strategy, shard_size=shard_size, replicate_size=world_size // shard_size, rank=rank)

    @property
    def num_shards(self) -> int:
        """Pieces the flat parameter is split into: the shard group size, or 1 for ``NO_SHARD``."""
        return self.shard_size if self.strategy.is_sharded else 1

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged: shard size x replicate size."""
        return self.shard_size * self.replicate_size

    def with_rank(self, rank: int) -> ShardingSpec:
        """The same geometry seen from another rank of the shard group."""
        return ShardingSpec(
            strategy=self.strategy,
            shard_size=self.shard_size,
            replicate_size=self.replicate_size,
            rank=rank,
        )

    def shard_numel(self, layout: FlatParamLayout) -> int:
        """Size of every rank's shard, padding included: ``ceil(total / num_shards)``."""
        return ceil_div(layout.total_numel, self.num_shards)

    def padded_numel(self, layout: FlatParamLayout) -> int:
        """The smallest multiple of ``num_shards`` that holds the flat parameter."""
        return self.shard_numel(layout) * self.num_shards

    def bounds(self, layout: FlatParamLayout, rank: int | None = None) -> ShardBounds:
        """The shard bounds of ``rank`` (default: this spec's rank)."""
        r = self.rank if rank is None else rank
        if self.strategy.is_sharded and not 0 <= r < self.shard_size:
            raise ValueError(f"rank: expected 0 <= rank < {self.shard_size}, got {r}")
        size = self.shard_numel(layout)
        if not self.strategy.is_sharded:
            return ShardBounds(rank=r, start=0, end=layout.total_numel, padding=0)
        start = min(r * size, layout.total_numel)
        end = min(start + size, layout.total_numel)
        return ShardBounds(rank=r, start=start, end=end, padding=size - (end - start))

    def all_bounds(self, layout: FlatParamLayout) -> tuple[ShardBounds, ...]:
        """The bounds of every shard, in rank order."""
        return tuple(self.bounds(layout, r) for r in range(self.num_shards))

    def shard_views(self, layout: FlatParamLayout, rank: int | None = None) -> tuple[ShardView, ...]:
        """The slices of original parameters held in ``rank``'s shard, in parameter order;
        parameters this rank holds none of are absent."""
        b = self.bounds(layout, rank)
        return tuple(_views_in_range(layout, b.start, b.end))


def unsharded_views(layout: FlatParamLayout) -> tuple[ShardView, ...]:
    """Views of every original parameter in the unsharded flat gradient."""
    return tuple(_views_in_range(layout, 0, layout.total_numel))


def _views_in_range(layout: FlatParamLayout, start: int, end: int) -> Iterable[ShardView]:
    for index, (param, offset) in enumerate(zip(layout.params, layout.offsets)):
        lo = max(start, offset)
        hi = min(end, offset + param.numel)
        if lo < hi:
            yield ShardView(
                param_index=index,
                param_name=param.name,
                offset_in_buffer=lo - start,
                offset_in_param=lo - offset,
                numel=hi - lo,
            )
