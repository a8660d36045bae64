"""Build the iteration simulation from timings measured on a cluster.

A benchmark times each collective alone, at one or more sizes, on the groups FSDP would use:

- all-gather and reduce-scatter over a shard group inside one node (``Link.INTRA_NODE``, HSDP)
  and over the whole world across nodes (``Link.INTER_NODE``, FSDP);
- all-reduce over the replicate group across nodes (``Link.INTER_NODE``, HSDP);

and each unit's forward and backward compute. ``fit_affine`` fits ``latency + bytes * ms_per_byte``
to each collective's samples; ``model_from_measurements`` prices every unit's collectives with
those fits (all-gather and reduce-scatter of its whole flat parameter, all-reduce of one shard of
it) and returns the ``IterationModel`` that ``simulate_iteration`` runs.

Where collectives slow each other or are slowed by compute (ranks sharing processor cores with
their communication), the benchmark also times collectives beside a load: ``SlowdownSample``
(a collective alone and beside a collective on the other link, or beside every rank's compute)
and ``SharingSample`` (two collectives of one link issued together). ``links_from_measurements``
turns them into the ``LinkModel``'s ``cross_link_slowdown``, ``compute_slowdown``
(``compute_slowdown_of``) and ``contention``. Nothing is fitted to iteration times, so a
measured iteration time can be compared with the prediction.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fsdp_core.plan.request import Plan
from fsdp_core.sim.costs import (
    FITTED,
    AffineCost,
    Collective,
    CollectiveFits,
    CollectiveSample,
    check_count,
    check_nonnegative,
    fit_affine,
    fit_collectives,
)
from fsdp_core.sim.iteration_model import CollectiveCosts, ComputeSlowdown, IterationModel, LinkModel, UnitCosts
from fsdp_core.sim.links import Link
from fsdp_core.spec.config import BackwardPrefetch

__all__ = [
    "AffineCost",
    "Collective",
    "CollectiveFits",
    "CollectiveSample",
    "Load",
    "MeasuredUnit",
    "Measurements",
    "SharingSample",
    "SlowdownSample",
    "compute_slowdown_of",
    "fit_affine",
    "fit_collectives",
    "links_from_measurements",
    "model_from_measurements",
    "slowdown",
]


class Load(enum.Enum):
    """What runs beside a collective timed under load."""

    OTHER_LINK = "other_link"
    """A collective on the other link: an intra-node one beside the replicate all-reduce across
    nodes, or that all-reduce beside intra-node traffic."""
    COMPUTE = "compute"
    """Every rank computing (a unit's forward and backward, over and over)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowdownSample:
    """``collective`` on ``link`` took ``alone_ms`` alone and ``loaded_ms`` beside ``load``."""

    collective: Collective
    link: Link
    load: Load
    alone_ms: float
    loaded_ms: float
    """Both e.g. means of several runs, of the same collective at the same size."""

    def __post_init__(self) -> None:
        if not isinstance(self.collective, Collective):
            raise TypeError(f"SlowdownSample.collective: expected a Collective, got {self.collective!r}")
        if not isinstance(self.link, Link):
            raise TypeError(f"SlowdownSample.link: expected a Link, got {self.link!r}")
        if not isinstance(self.load, Load):
            raise TypeError(f"SlowdownSample.load: expected a Load, got {self.load!r}")
        check_nonnegative("SlowdownSample", "alone_ms", self.alone_ms)
        check_nonnegative("SlowdownSample", "loaded_ms", self.loaded_ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class SharingSample:
    """Two collectives on ``link`` took ``first_ms`` and ``second_ms`` alone; issued together
    (both in flight at once), the later of the two landed after ``together_ms``."""

    link: Link
    first_ms: float
    second_ms: float
    together_ms: float

    def __post_init__(self) -> None:
        if not isinstance(self.link, Link):
            raise TypeError(f"SharingSample.link: expected a Link, got {self.link!r}")
        for name in ("first_ms", "second_ms", "together_ms"):
            check_nonnegative("SharingSample", name, getattr(self, name))


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredUnit:
    """One FSDP unit as measured."""

    name: str
    param_bytes: int
    """Its flat parameter's bytes as all-gathered and its gradient's as reduce-scattered
    (unsharded, padded, in the dtype on the wire); 0 for a unit without parameters."""
    forward_ms: float
    backward_ms: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"MeasuredUnit.name: expected a non-empty string, got {self.name!r}")
        check_count("MeasuredUnit", "param_bytes", self.param_bytes, 0)
        check_nonnegative("MeasuredUnit", "forward_ms", self.forward_ms)
        check_nonnegative("MeasuredUnit", "backward_ms", self.backward_ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurements:
    """What a benchmark measured on one cluster."""

    units: tuple[MeasuredUnit, ...]
    """In forward order; ``units[0]`` is the root (``IterationModel.units``)."""
    samples: tuple[CollectiveSample, ...]
    ranks_per_node: int
    """HSDP's shard group size: its replicate all-reduce reduces ``ceil(param_bytes / ranks_per_node)``
    bytes."""
    slowdowns: tuple[SlowdownSample, ...] = ()
    """Collectives timed alone and beside a load (``links_from_measurements``); none: no slowdown."""
    sharing: tuple[SharingSample, ...] = ()
    """Pairs of collectives of one link timed alone and together; none: ideal sharing."""

    def __post_init__(self) -> None:
        if (
            not isinstance(self.units, tuple)
            or not self.units
            or not all(isinstance(u, MeasuredUnit) for u in self.units)
        ):
            raise TypeError(f"Measurements.units: expected a non-empty tuple of MeasuredUnit, got {self.units!r}")
        if not isinstance(self.samples, tuple) or not all(isinstance(s, CollectiveSample) for s in self.samples):
            raise TypeError(f"Measurements.samples: expected a tuple of CollectiveSample, got {self.samples!r}")
        check_count("Measurements", "ranks_per_node", self.ranks_per_node, 1)
        if not isinstance(self.slowdowns, tuple) or not all(isinstance(s, SlowdownSample) for s in self.slowdowns):
            raise TypeError(f"Measurements.slowdowns: expected a tuple of SlowdownSample, got {self.slowdowns!r}")
        if not isinstance(self.sharing, tuple) or not all(isinstance(s, SharingSample) for s in self.sharing):
            raise TypeError(f"Measurements.sharing: expected a tuple of SharingSample, got {self.sharing!r}")


def model_from_measurements(
    measurements: Measurements,
    plans: Sequence[Plan | None],
    *,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = False,
) -> IterationModel:
    """The ``IterationModel`` of ``measurements`` run with ``plans`` (one per unit; e.g.
    ``unit_plans`` of ``FULL_SHARD`` or of ``HYBRID_SHARD`` with either all-reduce placement):
    each unit's measured compute, and its collectives priced by
    ``fit_collectives(measurements.samples)`` at its size. Simulate it with ``simulate_iteration``
    and ``links_from_measurements(measurements)`` (the default ``LinkModel`` when nothing was
    timed under load: the samples were timed on the links as they are)."""
    fits = fit_collectives(measurements.samples)
    units = []
    for u in measurements.units:
        shard = -(-u.param_bytes // measurements.ranks_per_node)
        costs = CollectiveCosts(
            all_gather_intra_ms=fits.all_gather_intra.ms(u.param_bytes),
            all_gather_inter_ms=fits.all_gather_inter.ms(u.param_bytes),
            reduce_scatter_intra_ms=fits.reduce_scatter_intra.ms(u.param_bytes),
            reduce_scatter_inter_ms=fits.reduce_scatter_inter.ms(u.param_bytes),
            all_reduce_inter_ms=fits.all_reduce_inter.ms(shard),
        )
        units.append(UnitCosts(name=u.name, forward_ms=u.forward_ms, backward_ms=u.backward_ms, collectives=costs))
    return IterationModel(
        units=tuple(units),
        plans=tuple(plans),
        ranks_per_node=measurements.ranks_per_node,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
    )


def slowdown(alone_ms: Iterable[float], loaded_ms: Iterable[float]) -> float:
    """How many times slower work ran under a load: ``sum(loaded_ms) / sum(alone_ms)`` over the
    same pieces of work timed both ways, at least 1 (a load never speeds anything up in the
    model); 1 without any time alone."""
    alone = math.fsum(alone_ms)
    return max(1.0, math.fsum(loaded_ms) / alone) if alone > 0 else 1.0


def _slowdown(samples: Sequence[SlowdownSample]) -> float:
    return slowdown((s.alone_ms for s in samples), (s.loaded_ms for s in samples))


def compute_slowdown_of(samples: Sequence[SlowdownSample], *, one_node: bool = False) -> ComputeSlowdown:
    """``LinkModel.compute_slowdown``: per collective and link (``ComputeSlowdown``'s fields),
    ``slowdown`` over its ``Load.COMPUTE`` samples (other loads are ignored); 1 where none was
    timed. With ``one_node`` (a world on one machine: every group's link is the same) the link
    is ignored: each collective's factor is over its samples on either link, for both links,
    the all-reduce's included."""
    computing = [s for s in samples if s.load is Load.COMPUTE]
    return ComputeSlowdown(
        **{
            name: _slowdown([s for s in computing if s.collective is c and (one_node or s.link is link)])
            for name, c, link in FITTED
        }
    )


def _contention(samples: Sequence[SharingSample]) -> float:
    """The ``contention`` under which the processor-sharing model gives each pair its
    ``together_ms``; over several pairs, from their sums; at least 1.

    Two transfers of ``a <= b`` ms alone, started together, share the link each at ``1 / (2c)``
    until the shorter is done (``2ac`` ms), then the longer runs alone (``b - a`` ms): together
    ``2ac + b - a``, so ``c = (together - (b - a)) / 2a``."""
    shared = math.fsum(s.together_ms - abs(s.second_ms - s.first_ms) for s in samples)
    split = math.fsum(2 * min(s.first_ms, s.second_ms) for s in samples)
    return max(1.0, shared / split) if split > 0 else 1.0


def links_from_measurements(measurements: Measurements, *, one_collective_per_group: bool = True) -> LinkModel:
    """The ``LinkModel`` of ``measurements``' loads (each factor >= 1; 1 where nothing was timed):

    - ``cross_link_slowdown``: ``sum(loaded) / sum(alone)`` over the ``Load.OTHER_LINK`` samples of
      intra-node collectives (the model slows only those; samples of an inter-node collective
      beside intra-node traffic are ignored, kept for the record: on the emulated cluster they
      show no slowdown);
    - ``compute_slowdown``: per collective and link, the same over its ``Load.COMPUTE`` samples
      (``compute_slowdown_of``);
    - ``contention``: from ``measurements.sharing`` (``_contention``). It acts only with
      ``one_collective_per_group=False``, which the caller sets where a group's collectives run
      side by side (gloo); pass it as the backend behaves.

    Bandwidths stay 1: the costs were timed on the links as they are."""

    def of(load: Load, link: Link) -> list[SlowdownSample]:
        return [s for s in measurements.slowdowns if s.load is load and s.link is link]

    return LinkModel(
        contention=_contention(measurements.sharing),
        cross_link_slowdown=_slowdown(of(Load.OTHER_LINK, Link.INTRA_NODE)),
        compute_slowdown=compute_slowdown_of(measurements.slowdowns),
        one_collective_per_group=one_collective_per_group,
    )
