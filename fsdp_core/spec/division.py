"""How gradients are averaged: divide factors and reduce operations, as one pure choice.

Averaging ``N`` data-parallel gradients means dividing their sum by ``N`` (or by a user's
factor). Where the division happens is a trade: dividing before the reduction avoids overflow
of low-precision sums, dividing after is cheaper, and a backend that averages inside the
collective (``ReduceOp.AVG``, or ``PREMUL_SUM`` with ``1/N``) needs no separate kernel.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import assert_never

import torch

__all__ = [
    "BackendCaps",
    "DivideFactors",
    "Division",
    "DivisionPolicy",
    "ReduceKind",
    "ReduceOpSpec",
    "divide_factors",
    "fsdp1_predivide_factor",
]


class ReduceKind(enum.Enum):
    """The reduction a collective applies (``torch.distributed.ReduceOp`` by name)."""

    SUM = "sum"
    AVG = "avg"
    PREMUL_SUM = "premul_sum"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReduceOpSpec:
    """A collective's reduce operation; ``premul`` multiplies each input first (``PREMUL_SUM`` only)."""

    kind: ReduceKind = ReduceKind.SUM
    premul: float = 1.0

    def __post_init__(self) -> None:
        if self.kind is not ReduceKind.PREMUL_SUM and self.premul != 1.0:
            raise ValueError(f"premul: only PREMUL_SUM takes a factor, {self.kind.name} got {self.premul}")
        if not math.isfinite(self.premul) or self.premul <= 0:
            raise ValueError(f"premul: expected a finite positive factor, got {self.premul}")

    def scale(self, group_size: int) -> float:
        """The factor the collective multiplies the sum by, over a group of ``group_size``."""
        match self.kind:
            case ReduceKind.AVG:
                return 1.0 / group_size
            case ReduceKind.SUM | ReduceKind.PREMUL_SUM:
                return self.premul
            case _:
                assert_never(self.kind)

    def __str__(self) -> str:
        match self.kind:
            case ReduceKind.PREMUL_SUM:
                return f"premul_sum({self.premul:.6g})"
            case ReduceKind.SUM | ReduceKind.AVG:
                return str(self.kind.value)
            case _:
                assert_never(self.kind)


SUM = ReduceOpSpec()


class DivisionPolicy(enum.Enum):
    """Where the average's division goes."""

    PRE_POST = "pre_post"
    """FSDP1: divide by a power of two near ``sqrt(N)`` before the reduction and by the rest after,
    whatever the dtype; every collective sums."""
    IN_COLLECTIVE = "in_collective"
    """FSDP2: let the backend average inside the collective for fp32/bf16 when it can; split the
    division around the reduction for fp16 (overflow risk); otherwise divide after."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendCaps:
    """What the collective backend can do, an input to the division choice."""

    supports_avg: bool = False
    """``ReduceOp.AVG`` (NCCL yes). Torch 2.13's gloo averages too, but taken as not: there the
    average's peaks depend on timing (with ``AVG`` the HSDP backward peak of
    ``tests/worlds/test_fully_shard_gloo.py`` moved by 6,272 bytes between two runs), while a sum
    then an in-place division holds the same bytes every run."""
    supports_premul_sum: bool = False
    """``PREMUL_SUM`` (NCCL only)."""

    @classmethod
    def for_backend(cls, name: str) -> BackendCaps:
        """Capabilities of a named backend: ``"nccl"`` or ``"gloo"``."""
        key = name.strip().lower()
        if key == "nccl":
            return cls(supports_avg=True, supports_premul_sum=True)
        if key == "gloo":
            return cls()
        raise ValueError(f"backend: unknown backend {name!r}; accepted: nccl, gloo")


@dataclass(frozen=True, slots=True, kw_only=True)
class Division:
    """The inputs to the division choice other than sizes and dtypes."""

    policy: DivisionPolicy = DivisionPolicy.PRE_POST
    backend: BackendCaps = BackendCaps()
    factor: float | None = None
    """Divide the sum by this instead of the data-parallel size (FSDP2's ``set_gradient_divide_factor``)."""

    def __post_init__(self) -> None:
        if self.factor is not None and (
            isinstance(self.factor, bool)
            or not isinstance(self.factor, (int, float))
            or not math.isfinite(self.factor)
            or self.factor <= 0
            or not math.isfinite(1.0 / self.factor)
        ):
            raise ValueError(
                f"divide_factor: expected None or a finite number > 0 with a finite reciprocal, got {self.factor!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class DivideFactors:
    """The division of one reduction, stated completely.

    The gradient is divided by ``pre`` before the first collective and by ``post`` after the
    last; the collectives apply ``reduce_scatter_op`` (the shard-group reduction, also used for
    ``NO_SHARD``'s all-reduce) and ``all_reduce_op`` (the replicate-group all-reduce). The
    product ``pre * post / (reduce_scatter_op.scale(shard) * all_reduce_op.scale(replicate))``
    is the total divisor.
    """

    pre: float
    post: float
    reduce_scatter_op: ReduceOpSpec
    all_reduce_op: ReduceOpSpec
    total: float
    """The total divisor: the data-parallel size, or the user's factor."""


def fsdp1_predivide_factor(world_size: int) -> int:
    """FSDP1's ``_get_gradient_predivide_factor``, a power of two near ``sqrt(world_size)``.

    Starting from 1, the factor doubles while the current factor divides ``world_size`` and is
    below ``world_size / factor``. The last doubling is not re-checked, so the result need not
    divide ``world_size`` (3 gives 2, 6 gives 4), exactly as in FSDP1."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return factor


def _split(total: float) -> tuple[float, float]:
    if float(total).is_integer() and total >= 1:
        pre = float(fsdp1_predivide_factor(int(total)))
        return pre, total / pre
    return 1.0, total


def divide_factors(
    *,
    shard_size: int,
    replicate_size: int,
    reduce_dtype: torch.dtype,
    division: Division = Division(),
) -> DivideFactors:
    """Choose the division for a reduction over ``shard_size x replicate_size`` ranks in ``reduce_dtype``.

    ``PRE_POST`` is FSDP1's rule, generalised to a user factor. ``IN_COLLECTIVE`` is FSDP2's
    ``_get_gradient_divide_factors``, with the backend's capabilities as an input: fp32/bf16
    average in the collective (``AVG`` on both groups, or ``PREMUL_SUM(1/f)`` on the first for a
    user factor) when the backend can; fp16 splits the division near ``sqrt(f)``; a backend that
    can do neither divides after the reduction.

    A group of one rank only ever sums (a no-op) and divides outside the collective: NCCL runs a
    one-rank collective as a local copy, and on an H200 (NCCL 2.28.9) a one-rank
    ``PREMUL_SUM(1/3)`` reduce-scatter returned its input undivided and a bf16 in-place one-rank
    all-reduce returned garbage (FSDP2 skips the collective at world size 1 for the same reason).
    """
    dp = shard_size * replicate_size
    total = float(dp) if division.factor is None else float(division.factor)
    if division.policy is DivisionPolicy.PRE_POST:
        pre, post = _split(total)
        return DivideFactors(pre=pre, post=post, reduce_scatter_op=SUM, all_reduce_op=SUM, total=total)
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16, torch.float64)
    if overflow_risk:
        pre, post = _split(total)
        return DivideFactors(pre=pre, post=post, reduce_scatter_op=SUM, all_reduce_op=SUM, total=total)
    if division.factor is None and dp == 1:
        return DivideFactors(pre=1.0, post=1.0, reduce_scatter_op=SUM, all_reduce_op=SUM, total=total)
    if division.factor is None and division.backend.supports_avg:
        avg = ReduceOpSpec(kind=ReduceKind.AVG)
        return DivideFactors(
            pre=1.0,
            post=1.0,
            reduce_scatter_op=avg if shard_size > 1 else SUM,
            all_reduce_op=avg if replicate_size > 1 else SUM,
            total=total,
        )
    if division.backend.supports_premul_sum and shard_size > 1:
        premul = ReduceOpSpec(kind=ReduceKind.PREMUL_SUM, premul=1.0 / total)
        return DivideFactors(pre=1.0, post=1.0, reduce_scatter_op=premul, all_reduce_op=SUM, total=total)
    return DivideFactors(pre=1.0, post=total, reduce_scatter_op=SUM, all_reduce_op=SUM, total=total)
