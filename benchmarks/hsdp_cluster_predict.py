"""HSDP cluster benchmark, its predictions: the calibrations of the ranks combined (means over
ranks, and each block's compute as the slowest rank's in each step), our three configurations
simulated from them, printed beside the measured times and written beside the profiled traces
(``benchmarks/bench_hsdp_cluster.py``'s docstring says what and why)."""

from __future__ import annotations

import dataclasses
import enum
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.hsdp_cluster_calibrate import REPEATS, Spans
from fsdp_core import HybridAllReduce, ShardingStrategy
from fsdp_core.sim import (
    IterationTimeline,
    Measurements,
    format_iteration,
    iteration_to_trace,
    links_from_measurements,
    model_from_measurements,
    simulate_iteration,
    unit_plans,
)


def slowest_rank(measured: Measurements, per_rank: Sequence[Spans]) -> Measurements:
    """``measured`` with each block's forward and backward the mean over steps of the slowest
    rank's in that step: a collective starts when the last rank of its group reaches it, so in a
    step each block costs its slowest rank's time, and a different rank may be slowest in each."""

    def worst(column: Sequence[tuple[float, ...]]) -> float:
        return statistics.fmean(max(step) for step in zip(*column))

    blocks = [
        dataclasses.replace(
            unit,
            forward_ms=worst([spans[i][0] for spans in per_rank]),
            backward_ms=worst([spans[i][1] for spans in per_rank]),
        )
        for i, unit in enumerate(measured.units[1:])
    ]
    return dataclasses.replace(measured, units=(measured.units[0], *blocks))


R = TypeVar("R")


def _mean_record(records: Sequence[R]) -> R:
    """``records[0]`` with each float field the mean over ``records`` (one per rank, each the
    same record timed there) and each tuple of records averaged the same way."""
    first = records[0]
    if not dataclasses.is_dataclass(first):
        return first
    changes: dict[str, object] = {}
    for field in dataclasses.fields(first):
        values = [getattr(r, field.name) for r in records]
        if isinstance(values[0], float):
            changes[field.name] = statistics.fmean(values)
        elif isinstance(values[0], tuple):
            changes[field.name] = tuple(_mean_record(column) for column in zip(*values))
    return dataclasses.replace(first, **changes)  # type: ignore[type-var]


def _simulate(measured: Measurements) -> dict[str, IterationTimeline]:
    """The simulated iteration of our three configurations from the calibration, each with the
    post-backward plans it runs (2 nodes of ``ranks_per_node``)."""
    world = 2 * measured.ranks_per_node
    units = len(measured.units)
    plans = {
        "ours-full": unit_plans(units, ShardingStrategy.FULL_SHARD, world),
        "ours-hybrid-sync": unit_plans(
            units, ShardingStrategy.HYBRID_SHARD, world, measured.ranks_per_node, hybrid_all_reduce=HybridAllReduce.SYNC
        ),
        "ours-hybrid-async": unit_plans(units, ShardingStrategy.HYBRID_SHARD, world, measured.ranks_per_node),
    }
    # gloo runs a group's asynchronous collectives side by side on its worker threads: FSDP's
    # backward all-gather and reduce-scatter of one group overlap (and share their link).
    links = links_from_measurements(measured, one_collective_per_group=False)
    return {config: simulate_iteration(model_from_measurements(measured, p), links) for config, p in plans.items()}


def _write_simulated(
    directory: Path, measurements: Measurements, outside: float, simulated: dict[str, IterationTimeline]
) -> None:
    """Beside the profiled traces: ``calibration.json`` (what was measured, means over ranks) and
    each simulated iteration as a chart (``simulated-<config>.txt``) and a Perfetto trace
    (``simulated-<config>.json``)."""

    def plain(value: object) -> object:
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    record = {"measurements": plain(dataclasses.asdict(measurements)), "outside_ms": outside}
    (directory / "calibration.json").write_text(json.dumps(record, indent=1) + "\n")
    for config, timeline in simulated.items():
        (directory / f"simulated-{config}.txt").write_text(format_iteration(timeline, width=120) + "\n")
        (directory / f"simulated-{config}.json").write_text(json.dumps(iteration_to_trace(timeline, name=config)))


def report(
    per_rank: Sequence[tuple[Measurements, float, Spans]], measured: dict[str, float], trace: Path | None
) -> None:
    """Print what the ranks' calibrations (``calibrate``'s results, in rank order) measured, and
    our three configurations simulated from them beside their ``measured`` median ms/iteration;
    with a ``trace`` directory, write the simulated iterations there too (``_write_simulated``)."""
    measurements = _mean_record([m for m, _, _ in per_rank])
    outside = statistics.fmean(o for _, o, _ in per_rank)
    slowest = slowest_rank(measurements, [spans for _, _, spans in per_rank])
    print(
        f"  collectives alone (mean of {REPEATS}, mean over ranks): "
        + "; ".join(
            f"{s.collective.value} {s.link.value} {s.nbytes / 2**20:.2f} MiB {s.ms:.1f} ms"
            for s in measurements.samples
        )
    )
    print(
        "  beside a load (alone -> loaded ms): "
        + "; ".join(
            f"{s.collective.value} {s.link.value} | {s.load.value} {s.alone_ms:.1f} -> {s.loaded_ms:.1f}"
            for s in measurements.slowdowns
        )
    )
    print(
        "  all-gather + reduce-scatter of one group, alone -> together (ms): "
        + "; ".join(
            f"{s.link.value} {s.first_ms:.1f} + {s.second_ms:.1f} -> {s.together_ms:.1f}" for s in measurements.sharing
        )
    )
    print(
        "  compute per unit (fwd/bwd ms): "
        + ", ".join(f"{u.name} {u.forward_ms:.1f}/{u.backward_ms:.1f}" for u in measurements.units)
    )
    print(
        "  compute per unit, the slowest rank's in each step (fwd/bwd ms): "
        + ", ".join(f"{u.name} {u.forward_ms:.1f}/{u.backward_ms:.1f}" for u in slowest.units)
    )
    simulated = _simulate(measurements)
    links = simulated["ours-full"].links
    c = links.compute_slowdown
    print(
        f"  measured link model: cross_link_slowdown {links.cross_link_slowdown:.2f}; beside compute: "
        f"all-gather {c.all_gather_intra:.2f} intra / {c.all_gather_inter:.2f} inter, reduce-scatter "
        f"{c.reduce_scatter_intra:.2f} / {c.reduce_scatter_inter:.2f}, all-reduce {c.all_reduce_inter:.2f}; "
        f"contention {links.contention:.2f} (collectives of one group side by side, as gloo runs them)"
    )
    print(
        f"  outside the simulated iteration (input, optimizer step, zero_grad, barrier): {outside:.1f} ms, "
        f"added to each prediction"
    )
    for compute, timelines in (("the mean rank", simulated), ("the slowest rank per step", _simulate(slowest))):
        for config, timeline in timelines.items():
            ms = timeline.iteration_ms + outside
            print(
                f"  simulated {config:<18} {ms:8.1f} ms/iter   measured {measured[config]:8.1f}   "
                f"simulated/measured {ms / measured[config]:.2f}   (compute of {compute})"
            )
    if trace is not None:
        _write_simulated(trace, measurements, outside, simulated)
