"""The small model and the measured cluster shared by the iteration simulator's tests
(``test_iteration_*.py``).

Collective costs, unit costs and the synthetic measurements are written out here by hand, so
that every test works its expected times out by hand from them; nothing here is computed by
the simulator under test.
"""

from __future__ import annotations

from fsdp_core import BackwardPrefetch, HybridAllReduce, Plan, ShardingStrategy
from fsdp_core.sim import (
    Activity,
    Collective,
    CollectiveCosts,
    CollectiveSample,
    IterationModel,
    IterationTimeline,
    Link,
    MeasuredUnit,
    Measurements,
    UnitCosts,
    unit_plans,
)

INTER, INTRA = Link.INTER_NODE, Link.INTRA_NODE


# -- one iteration of a small model -------------------------------------------------------------

COSTS = CollectiveCosts(
    all_gather_intra_ms=3,
    all_gather_inter_ms=10,
    reduce_scatter_intra_ms=3,
    reduce_scatter_inter_ms=10,
    all_reduce_inter_ms=20,
)
NOTHING = CollectiveCosts(
    all_gather_intra_ms=0,
    all_gather_inter_ms=0,
    reduce_scatter_intra_ms=0,
    reduce_scatter_inter_ms=0,
    all_reduce_inter_ms=0,
)


FSDP, HSDP_SYNC, HSDP_ASYNC = "fsdp", "hsdp_sync", "hsdp_async"
"""Three ways to run the small model on 2 nodes of 8 ranks: ``FULL_SHARD`` over all 16, or
``HYBRID_SHARD`` with a shard group per node and the all-reduce sync or async."""


def plans_of(kind: str, units: int = 3) -> tuple[Plan, ...]:
    if kind == FSDP:
        return unit_plans(units, ShardingStrategy.FULL_SHARD, 16)
    placement = HybridAllReduce.SYNC if kind == HSDP_SYNC else HybridAllReduce.ASYNC
    return unit_plans(units, ShardingStrategy.HYBRID_SHARD, 16, 8, hybrid_all_reduce=placement)


def small(
    kind: str = HSDP_ASYNC,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = False,
) -> IterationModel:
    """A root without cost wrapping two units of forward 1 ms, backward 2 ms, run as ``kind``."""
    root = UnitCosts(name="root", forward_ms=0, backward_ms=0, collectives=NOTHING)
    units = tuple(UnitCosts(name=f"u{i}", forward_ms=1, backward_ms=2, collectives=COSTS) for i in (1, 2))
    return IterationModel(
        units=(root, *units),
        plans=plans_of(kind),
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
    )


def at(timeline: IterationTimeline, activity: Activity, unit: int) -> tuple[float, float]:
    i = timeline.find(activity, unit)
    return (i.start_ms, i.end_ms)


# -- measurements of an emulated cluster ---------------------------------------------------


def sample(collective: Collective, link: Link, nbytes: int, ms: float) -> CollectiveSample:
    return CollectiveSample(collective=collective, link=link, nbytes=nbytes, ms=ms)


def emulated_cluster() -> Measurements:
    """Synthetic numbers shaped like the later benchmark: 2 nodes x 2 ranks, 400 Mbit/s between."""
    samples = []
    for n in (1_000_000, 4_000_000):
        samples += [
            sample(Collective.ALL_GATHER, INTRA, n, 0.1 + n / 2e6),
            sample(Collective.REDUCE_SCATTER, INTRA, n, 0.2 + n / 2e6),
            sample(Collective.ALL_GATHER, INTER, n, 1.0 + n / 5e4),
            sample(Collective.REDUCE_SCATTER, INTER, n, 1.5 + n / 5e4),
            sample(Collective.ALL_REDUCE, INTER, n // 2, 2.0 + n / 5e4),
            sample(Collective.ALL_REDUCE, INTRA, n, 99.0),  # not needed: ignored
        ]
    units = (
        MeasuredUnit(name="root", param_bytes=2_000_001, forward_ms=3.0, backward_ms=6.0),
        *(MeasuredUnit(name=f"layer{i}", param_bytes=4_000_000, forward_ms=5.0, backward_ms=10.0) for i in range(2)),
    )
    return Measurements(units=units, samples=tuple(samples), ranks_per_node=2)
