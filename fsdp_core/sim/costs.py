"""The one cost model of ``fsdp_core.sim``: what a collective, an element-wise op and a copy to
the host cost. The plan timeline (``simulate_timeline``, ``fsdp-plan``) and the iteration
simulator (``simulate_iteration``) both price with ``CostModel``.

A collective costs ``latency + bytes on the wire / the link's bandwidth`` (``comm_volume``'s ring
bytes per rank), or, where it was timed (``CostModel.measured``), what ``fit_affine`` fitted to
its timings: ``latency_ms + nbytes * ms_per_byte`` of the size FSDP passes (``CollectiveSample``).
An element-wise op costs the bytes it reads and writes over device memory bandwidth, an offload
its bytes over the host link.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from fsdp_core.plan.comm import CommVolume
from fsdp_core.sim.links import Link

__all__ = [
    "AffineCost",
    "Collective",
    "CollectiveFits",
    "CollectiveSample",
    "CostModel",
    "describe_cost",
    "fit_affine",
    "fit_collectives",
    "fit_table",
]


class Collective(enum.Enum):
    """A collective FSDP issues."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


def check_nonnegative(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{owner}.{name}: expected a finite number >= 0, got {value!r}")


def check_count(owner: str, name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}.{name}: expected an int >= {low}, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveSample:
    """One measurement: ``collective`` on ``link``, alone, of ``nbytes``, took ``ms``."""

    collective: Collective
    link: Link
    nbytes: int
    """The size FSDP passes: for all-gather the gathered (unsharded) output, for reduce-scatter
    the unsharded input, for all-reduce the tensor reduced (one shard)."""
    ms: float
    """Its time alone, e.g. the mean of several runs."""

    def __post_init__(self) -> None:
        if not isinstance(self.collective, Collective):
            raise TypeError(f"CollectiveSample.collective: expected a Collective, got {self.collective!r}")
        if not isinstance(self.link, Link):
            raise TypeError(f"CollectiveSample.link: expected a Link, got {self.link!r}")
        check_count("CollectiveSample", "nbytes", self.nbytes, 1)
        check_nonnegative("CollectiveSample", "ms", self.ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class AffineCost:
    """``latency_ms + nbytes * ms_per_byte``."""

    latency_ms: float
    ms_per_byte: float

    def __post_init__(self) -> None:
        check_nonnegative("AffineCost", "latency_ms", self.latency_ms)
        check_nonnegative("AffineCost", "ms_per_byte", self.ms_per_byte)

    def ms(self, nbytes: int) -> float:
        """The cost of ``nbytes``; 0 for 0 bytes (nothing to send)."""
        return 0.0 if nbytes == 0 else self.latency_ms + nbytes * self.ms_per_byte


def fit_affine(samples: Sequence[CollectiveSample]) -> AffineCost:
    """Least squares of ``ms = latency + nbytes * ms_per_byte`` over ``samples`` (at least one).

    With a single size the latency cannot be told apart from the bandwidth: the line goes through
    the origin (latency 0) and the mean. A fit with a negative latency is redone through the
    origin, one with a negative slope is flat at the mean; so both terms are >= 0.
    Deterministic: the result depends only on the multiset of samples."""
    if not samples:
        raise ValueError("samples: expected at least one CollectiveSample")
    points = sorted((float(s.nbytes), float(s.ms)) for s in samples)
    n = len(points)
    mean_x = math.fsum(x for x, _ in points) / n
    mean_y = math.fsum(y for _, y in points) / n
    sxx = math.fsum((x - mean_x) ** 2 for x, _ in points)
    if sxx > 0:
        slope = math.fsum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
        latency = mean_y - slope * mean_x
        if slope < 0:
            return AffineCost(latency_ms=mean_y, ms_per_byte=0.0)
        if latency >= 0:
            return AffineCost(latency_ms=latency, ms_per_byte=slope)
    through_origin = math.fsum(x * y for x, y in points) / math.fsum(x * x for x, _ in points)
    return AffineCost(latency_ms=0.0, ms_per_byte=through_origin)


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveFits:
    """The fitted cost of each collective ``model_from_measurements`` needs."""

    all_gather_intra: AffineCost
    all_gather_inter: AffineCost
    reduce_scatter_intra: AffineCost
    reduce_scatter_inter: AffineCost
    all_reduce_inter: AffineCost

    def table(self) -> tuple[tuple[Collective, Link, AffineCost], ...]:
        """Every fit, as ``CostModel.measured`` takes them."""
        return tuple((c, link, getattr(self, name)) for name, c, link in FITTED)


FITTED: tuple[tuple[str, Collective, Link], ...] = (
    ("all_gather_intra", Collective.ALL_GATHER, Link.INTRA_NODE),
    ("all_gather_inter", Collective.ALL_GATHER, Link.INTER_NODE),
    ("reduce_scatter_intra", Collective.REDUCE_SCATTER, Link.INTRA_NODE),
    ("reduce_scatter_inter", Collective.REDUCE_SCATTER, Link.INTER_NODE),
    ("all_reduce_inter", Collective.ALL_REDUCE, Link.INTER_NODE),
)


def fit_table(samples: Sequence[CollectiveSample]) -> tuple[tuple[Collective, Link, AffineCost], ...]:
    """``fit_affine`` of every (collective, link) ``samples`` hold, in the order they first
    appear: ``CostModel.measured``."""
    pairs = list(dict.fromkeys((s.collective, s.link) for s in samples))
    return tuple(
        (c, link, fit_affine([s for s in samples if s.collective is c and s.link is link])) for c, link in pairs
    )


def fit_collectives(samples: Sequence[CollectiveSample]) -> CollectiveFits:
    """``fit_affine`` per (collective, link) of ``CollectiveFits``; ``ValueError`` naming every
    one without samples. Samples of other pairs (an intra-node all-reduce) are ignored."""
    missing = [
        f"{c.value} on {link.value}"
        for _, c, link in FITTED
        if not any(s.collective is c and s.link is link for s in samples)
    ]
    if missing:
        raise ValueError(f"samples: no measurement of {', '.join(missing)}")
    fits = {name: fit_affine([s for s in samples if s.collective is c and s.link is link]) for name, c, link in FITTED}
    return CollectiveFits(
        all_gather_intra=fits["all_gather_intra"],
        all_gather_inter=fits["all_gather_inter"],
        reduce_scatter_intra=fits["reduce_scatter_intra"],
        reduce_scatter_inter=fits["reduce_scatter_inter"],
        all_reduce_inter=fits["all_reduce_inter"],
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Bandwidths in bytes per second and a per-collective latency in seconds; where collectives
    were timed, their fits instead (module docstring)."""

    device_bandwidth: float = 2.0e12
    """Device memory bandwidth for element-wise ops (an H100's HBM is ~3e12)."""
    intra_node_bandwidth: float = 1.5e11
    """Per-rank bus bandwidth of a group inside one node (NVLink-class): ``Link.INTRA_NODE``."""
    inter_node_bandwidth: float = 2.5e10
    """Per-rank bus bandwidth of a group across nodes (InfiniBand-class): ``Link.INTER_NODE``."""
    host_bandwidth: float = 2.5e10
    """Device-to-host copy bandwidth (PCIe)."""
    collective_latency: float = 2.0e-5
    measured: tuple[tuple[Collective, Link, AffineCost], ...] = ()
    """Fits of timed collectives (``fit_table``), used instead of latency and bandwidth for the
    collectives and links they cover."""

    def __post_init__(self) -> None:
        for name in ("device_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth", "host_bandwidth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name}: expected a positive bandwidth, got {value}")
        if isinstance(self.collective_latency, bool) or not 0 <= self.collective_latency < math.inf:
            raise ValueError(f"collective_latency: expected >= 0, got {self.collective_latency}")
        if not isinstance(self.measured, tuple) or not all(
            isinstance(c, Collective) and isinstance(link, Link) and isinstance(fit, AffineCost)
            for c, link, fit in self.measured
        ):
            raise TypeError(f"measured: expected a tuple of (Collective, Link, AffineCost), got {self.measured!r}")

    def bandwidth(self, link: Link) -> float:
        """``link``'s per-rank bus bandwidth."""
        match link:
            case Link.INTRA_NODE:
                return self.intra_node_bandwidth
            case Link.INTER_NODE:
                return self.inter_node_bandwidth
            case _:
                assert_never(link)

    def collective_seconds(self, volume: CommVolume, link: Link) -> float:
        """What ``volume``'s collective costs alone on ``link``."""
        collective = Collective(volume.collective)
        fit = next((f for c, k, f in self.measured if c is collective and k is link), None)
        if fit is not None:
            nbytes = volume.output_bytes if collective is Collective.ALL_GATHER else volume.input_bytes
            return fit.ms(nbytes) / 1e3
        return self.collective_latency + volume.bytes / self.bandwidth(link)

    def elementwise_seconds(self, nbytes: int) -> float:
        """An element-wise op that reads and writes ``nbytes`` of device memory."""
        return nbytes / self.device_bandwidth

    def host_copy_seconds(self, nbytes: int) -> float:
        """A copy of ``nbytes`` between device and host."""
        return nbytes / self.host_bandwidth


def describe_cost(cost: CostModel) -> str:
    """One line naming what ``cost`` assumes, for a reader of a simulated timeline."""
    gb = 1e9
    timed = "; timed collectives as fitted" if cost.measured else ""
    return (
        f"assumed: intra-node {cost.intra_node_bandwidth / gb:g} GB/s and inter-node "
        f"{cost.inter_node_bandwidth / gb:g} GB/s per rank, device memory {cost.device_bandwidth / gb:g} GB/s, "
        f"device-to-host {cost.host_bandwidth / gb:g} GB/s, {cost.collective_latency * 1e6:g} us per collective"
        f"{timed} (fsdp_core.sim.CostModel)"
    )
