"""Step-time benchmark, its models: the simulation of a configuration from measured inputs,
the slowdowns of sharing one core, and the fitted in-step costs (``InStep``)
(``benchmarks/bench_step_time.py``'s docstring says what and why)."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.step_time_measure import Beside, Measured, Size, unit_collectives
from fsdp_core.memory.plan_memory import Executor
from fsdp_core.sim import (
    Activity,
    Collective,
    CollectiveSample,
    CostModel,
    IterationTimeline,
    Link,
    LinkModel,
    Load,
    SlowdownSample,
    compute_slowdown_of,
    model_of_units,
    simulate_iteration,
    slowdown,
)
from fsdp_shell.predict import Prediction

HOST_WORK = (Activity.FORWARD, Activity.BACKWARD, Activity.ELEMENTWISE)
"""The simulated activities that are computing, not communicating (the element-wise ops the CPU
runtime runs on its lane thread among them)."""


GLOO = LinkModel(one_collective_per_group=False)
"""gloo runs a group's asynchronous collectives side by side; nothing else slows anything."""


def simulate(
    p: Prediction,
    compute: list[tuple[float, float]],
    table: object,
    world: int,
    links: LinkModel = GLOO,
    check_ms: float | None = None,
) -> IterationTimeline:
    """The simulated iteration of ``p``'s units on the CPU runtime (``Executor.CPU_LANE``): the
    synchronising one, after one inside ``no_sync()`` when ``p`` accumulates (as measured),
    ending with the event check, costing ``check_ms`` when given."""
    assert isinstance(table, tuple)
    model = model_of_units(
        p.units,
        p.trace,
        root=len(p.units) - 1,
        compute_ms=compute,
        cost=CostModel(measured=table),
        ranks_per_node=world,
        backward_prefetch=p.options.backward_prefetch,
        forward_prefetch=p.options.forward_prefetch,
        executor=Executor.CPU_LANE,
        follows_no_sync=p.accumulate > 1,
        event_check_ms=check_ms,
    )
    return simulate_iteration(model, links)


def working_ms(timeline: IterationTimeline) -> float:
    """Of the simulated iteration, the ms spent computing (``HOST_WORK``): nearly all of it on
    the host thread, the counterpart of a step's time outside collectives' ``wait``."""
    return sum(i.duration_ms for i in timeline.intervals if i.activity in HOST_WORK)


def collective_counts(timeline: IterationTimeline) -> tuple[int, int]:
    """The iteration's all-gathers and its reductions (reduce-scatters, all-reduces)."""
    gathers = sum(i.activity in (Activity.FORWARD_ALL_GATHER, Activity.BACKWARD_ALL_GATHER) for i in timeline.intervals)
    reductions = sum(i.activity in (Activity.REDUCE_SCATTER, Activity.ALL_REDUCE) for i in timeline.intervals)
    return gathers, reductions


def is_event_check(size: Size) -> bool:
    """Whether ``size`` is the event check's all-gather (``sizes``), timed for itself and kept out
    of the fits of the units' collectives."""
    return size[0] is Collective.ALL_GATHER and size[3] is torch.int64


def event_check_ms(wanted: list[Size], ranks: list[Measured]) -> float | None:
    """The event check's time after compute (``in_step``); None in a world without it."""
    k = next((k for k, size in enumerate(wanted) if is_event_check(size)), None)
    return None if k is None else in_step(ranks, k)


def in_step(ranks: list[Measured], k: int) -> float:
    """Collective ``k``'s time after compute (``Beside.collective_after_compute``), the rank's that
    waited least: the others waited, besides, for the ranks that computed longer, which the
    simulated compute (the slowest rank's, ``_worst``) already holds."""
    return min(r.collectives[k].collective_after_compute for r in ranks)


def samples(wanted: list[Size], ranks: list[Measured]) -> list[CollectiveSample]:
    """Each of the units' collectives' time after compute (``in_step``), by the bytes FSDP
    passes, on the intra-node link."""
    out = []
    for k, (collective, _, numel, dtype) in enumerate(wanted):
        if is_event_check(wanted[k]):
            continue
        ms = in_step(ranks, k)
        out.append(
            CollectiveSample(collective=collective, link=Link.INTRA_NODE, nbytes=max(1, numel * dtype.itemsize), ms=ms)
        )
    return out


def sharing_one_core(wanted: list[Size], ranks: list[Measured]) -> LinkModel:
    """How a world's collectives and compute slow each other, measured in it (``Beside``, the
    worst rank's): gloo runs a group's collectives side by side
    (``one_collective_per_group=False``); each kind of collective beside compute
    (``compute_slowdown_of``, every link alike: the world is one machine) and compute beside
    collectives (``transfers_slow_compute``: ``slowdown`` over the sizes)."""
    measured = [
        (size[0], Beside.each(max, (r.collectives[k] for r in ranks)))
        for k, size in enumerate(wanted)
        if not is_event_check(size)
    ]
    beside_compute = [
        SlowdownSample(
            collective=collective,
            link=Link.INTRA_NODE,
            load=Load.COMPUTE,
            alone_ms=b.collective_alone,
            loaded_ms=b.collective_loaded,
        )
        for collective, b in measured
    ]
    return LinkModel(
        one_collective_per_group=False,
        compute_slowdown=compute_slowdown_of(beside_compute, one_node=True),
        transfers_slow_compute=slowdown(
            (b.compute_alone for _, b in measured),
            (b.compute_loaded for _, b in measured),
        ),
    )


def collective_sizes(p: Prediction, wanted: list[Size]) -> dict[tuple[int, Activity], int]:
    """``unit_collectives``, each as the index of its size in ``wanted`` (``sizes``)."""
    index = {size: k for k, size in enumerate(wanted)}
    return {key: index[size] for key, size in unit_collectives(p).items()}


def ranks_per_core(world: int) -> int:
    """How many of a world's ranks ``pin`` puts on one core (at most)."""
    return math.ceil(world / len(os.sched_getaffinity(0)))


def _worst(ranks: list[Measured]) -> list[tuple[float, float]]:
    """Each unit's compute, the slowest rank's."""
    return [(max(c[0] for c in column), max(c[1] for c in column)) for column in zip(*(r.compute for r in ranks))]


@dataclasses.dataclass(frozen=True)
class Row:
    """One world's measurement of a configuration and its simulated iteration (ms per step)."""

    name: str
    simulated: float
    """The simulated iteration plus the optimizer step, before ``InStep`` is added."""
    measured: float
    gathers: int
    reductions: int
    parts: str


@dataclasses.dataclass(frozen=True)
class InStep:
    """What a collective costs inside a training step beyond its time alone: the host issuing it
    and handing it to gloo's threads, the wake-up of a rank that computed meanwhile. The free
    parameters of the prediction, each fitted (least squares, >= 0) on the other configurations'
    rows, never on the row it predicts."""

    per_gather_ms: float
    per_reduction_ms: float

    def of(self, row: Row) -> float:
        return self.per_gather_ms * row.gathers + self.per_reduction_ms * row.reductions

    @staticmethod
    def fit(rows: list[Row]) -> InStep:
        """The non-negative least-squares fit of ``measured - simulated`` over ``rows``: of the
        unconstrained fits with both, one or neither parameter free, the best with none < 0."""
        counts = torch.tensor([[row.gathers, row.reductions] for row in rows], dtype=torch.float64)
        gaps = torch.tensor([[row.measured - row.simulated] for row in rows], dtype=torch.float64)
        candidates = [InStep(0.0, 0.0)]
        for free in ([0, 1], [0], [1]):
            solution = torch.linalg.lstsq(counts[:, free], gaps).solution.flatten().tolist()
            if min(solution) >= 0:
                values = dict(zip(free, solution))
                candidates.append(InStep(values.get(0, 0.0), values.get(1, 0.0)))
        return min(candidates, key=lambda c: sum((row.measured - row.simulated - c.of(row)) ** 2 for row in rows))
