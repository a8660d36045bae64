"""Step time, predicted then measured: gloo on loopback, the CPU runtime, per configuration.

Run on demand: ``python benchmarks/bench_step_time.py [--configs NAME,...] [--steps 20]``
(the configurations of ``benchmarks/bench_predict.py``).

The prediction is ``fsdp_core.sim.simulate_iteration`` of the model's real units
(``model_of_units``: their plans, the recorded all-gather orders, ``Executor.CPU_LANE``: where
the CPU runtime runs each op), plus the optimizer step. Its inputs are measured in the world
that then trains, in turns with its training steps (``measure``: five rounds, each timing the
inputs and then a fifth of the steps, so that a slow phase of the machine falls on both), none
on the configuration it predicts:

- **compute**: each unit's forward and backward, the step run for real on every rank of the
  world at once (as they will train, sharing the machine), with FSDP's parameter views but none
  of its hooks' work (``time_trace``); the slowest rank's;
- **collectives**: every size the units' plans and all-gathers use, with the runtime's own gloo
  collectives, each issued after every rank computed for as long as a unit's backward (as the
  step meets it) and timed to its end; the *mean* of 30 calls (``Beside.collective_after_compute``:
  the latency here has a fast and a slow mode, and the median is the fast one), the rank's that
  waited least (``in_step``); ``fit_table`` fits them (``CostModel.measured``). The event check
  that ends each backward (``IterationModel.event_check``) is timed so too, and priced as timed;
- **how collectives and compute share a rank's core** (``sharing_one_core``): each size also
  timed while every rank computes, and compute timed while collectives of that size are in
  flight, in the same world: ``LinkModel.compute_slowdown`` per kind of collective (measured
  up to 16x: gloo's threads wait for the core the rank computes on) and
  ``LinkModel.transfers_slow_compute`` (1.0-2.3x); gloo runs a group's collectives side by side
  (``one_collective_per_group=False``);
- **FSDP's host work per unit** (hooks, the plan interpreter, casts): calibrated on a world of
  one rank training the same model: what its measured iteration takes beyond its simulated one
  without host work, shared equally by the units, half in forward, half in backward;
- **the optimizer step**: ``step()`` and ``zero_grad()`` on tensors of the shapes each rank's
  optimizer steps (``optimized_tensors``), every rank at once;
- **each collective's processor work**: the processor time gloo's threads spend on one call
  (``Beside.processor_ms``, from ``/proc/self/task/*/schedstat``).

Each world is simulated by two models of how a rank's collectives share its core, printed side
by side and summarized apart. The first takes the slowdowns measured above
(``sharing_one_core``). The second, the core's (``core_model``), slows nothing in the simulation
and instead charges the core: the host work calibrated on one rank is stretched by the ranks
``pin`` puts on one core (they take turns on it), and the collectives' processor work, of every
rank on the core, is added where it falls beside compute
(``IterationTimeline.work_beside_compute_ms``).

What a collective costs *inside* a step beyond that (the host issuing it and handing it to
gloo's threads, what the plan interpreter does around it) is not measured apart: it is the
prediction's two free parameters, ``InStep``'s ms per all-gather and ms per reduction,
fitted (least squares, >= 0) on the other configurations' rows, never on the row predicted.

Measured: the median over ``--steps`` steps (after warm-up) of each rank's forward + backward
(the synchronising one, after ``no_sync()`` ones when the configuration accumulates) and
optimizer time, the worst rank. Each rank's host thread runs on one core of its own (``pin``;
``--pin all`` puts all of the rank's threads there, ``--pin none`` leaves them to the
scheduler), while timing the inputs as while training. Printed per
world as it runs: the simulated and measured ms, and where the time goes (the host thread's time
blocked in collectives' ``wait`` against the simulated iteration's time not computing, the rest
against the simulated compute and host work; where the rank's core went, ``Core``); at the end,
predicted / measured per configuration (simulated + ``InStep``) and how many are within 10%.
With ``--repeat N`` each configuration's world is started N times in the same run, each
simulated from its own inputs and measured: the spread of the measured times is how closely
this machine can check any prediction. The summary then counts the rows within 10% of their
configuration's mean over its worlds (``own_mean_within``), and compares each configuration's
mean prediction over its worlds with their mean measured time (what a prediction made before
launch can promise where one world's step differs from the next's)."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_predict import CONFIGS
from benchmarks.step_time_measure import Measured, Pinning, measure, sizes
from benchmarks.step_time_model import (
    GLOO,
    InStep,
    Row,
    _worst,
    collective_counts,
    collective_sizes,
    event_check_ms,
    ranks_per_core,
    samples,
    sharing_one_core,
    simulate,
    working_ms,
)
from fsdp_core.sim import (
    Activity,
    Interval,
    fit_table,
)
from fsdp_shell.cli.launch import run_world
from fsdp_shell.memory.workload import Config
from fsdp_shell.predict import Prediction
from fsdp_shell.predict.against import predict


def run(
    name: str, cfg: Config, steps: int, warmup: int, repeat: int = 1, pinning: Pinning = Pinning.HOST
) -> tuple[list[Row], list[Row]]:
    """Per world started (``repeat`` of them), ``cfg`` measured and simulated (ms per step) by
    both models (``sharing_one_core``'s slowdowns, and the core's: ``core_model``), FSDP's host
    work calibrated once, on a world of one; each rank's threads pinned as ``pinning`` says."""
    p = predict(cfg)
    solo_cfg = dataclasses.replace(cfg, ranks=1)
    solo = predict(solo_cfg)
    wanted, solo_wanted = sizes(p), sizes(solo)
    (alone,) = run_world(1, measure, (solo_cfg, solo_wanted, steps, warmup, pinning), timeout=900)
    bare = simulate(solo, alone.compute, fit_table(samples(solo_wanted, [alone])), 1).iteration_ms
    host = max(0.0, alone.forward_backward_ms - bare)
    share = host / sum(u is not None for u in p.units) / 2
    where = collective_sizes(p, wanted)
    rows, core_rows = [], []
    for _ in range(repeat):
        ranks = run_world(cfg.world, measure, (cfg, wanted, steps, warmup, pinning), timeout=900)
        compute = _worst(ranks)
        with_host = [(f + share, b + share) if u is not None else (f, b) for u, (f, b) in zip(p.units, compute)]
        links = sharing_one_core(wanted, ranks)
        check = event_check_ms(wanted, ranks)
        table = fit_table(samples(wanted, ranks))
        timeline = simulate(p, with_host, table, cfg.world, links, check)
        iteration, working = timeline.iteration_ms, working_ms(timeline)
        optimizer = max(r.optimizer_alone_ms for r in ranks)
        slowest = max(ranks, key=lambda r: r.forward_backward_ms + r.optimizer_ms)
        gathers, reductions = collective_counts(timeline)
        core, core_parts = core_model(p, compute, share, table, cfg.world, check, where, ranks)
        parts = (
            f"compute {sum(f + b for f, b in compute):.2f}, host work {host:.2f} (one rank: "
            f"{alone.forward_backward_ms:.2f} measured, {bare:.2f} simulated without); iteration "
            f"{iteration:.2f} = working {working:.2f} + waiting {iteration - working:.2f}, measured "
            f"{slowest.forward_backward_ms:.2f} = {slowest.forward_backward_ms - slowest.waits_ms:.2f} + "
            f"{slowest.waits_ms:.2f}; optimizer {optimizer:.2f}, measured {slowest.optimizer_ms:.2f}; "
            f"{gathers} all-gathers, {reductions} reductions, event check {check or 0:.2f}; beside compute: all-gather "
            f"x{links.compute_slowdown.all_gather_intra:.2f}, reduce-scatter "
            f"x{links.compute_slowdown.reduce_scatter_intra:.2f}, all-reduce "
            f"x{links.compute_slowdown.all_reduce_inter:.2f}; compute beside them x{links.transfers_slow_compute:.2f}; "
            f"{slowest.core} (one rank: {alone.core}); core model: {core_parts}"
        )
        measured = slowest.forward_backward_ms + slowest.optimizer_ms
        rows.append(Row(name, iteration + optimizer, measured, gathers, reductions, parts))
        core_rows.append(Row(name, core + optimizer, measured, gathers, reductions, core_parts))
        print(
            f"{name:<46} simulated {rows[-1].simulated:>8.2f}, core model {core_rows[-1].simulated:>8.2f}, "
            f"measured {measured:>8.2f} ms  {parts}",
            flush=True,
        )
    return rows, core_rows


def core_model(
    p: Prediction,
    compute: list[tuple[float, float]],
    share: float,
    table: object,
    world: int,
    check: float | None,
    where: dict[tuple[int, Activity], int],
    ranks: list[Measured],
) -> tuple[float, str]:
    """The iteration (ms) with the rank's core as the shared resource: collectives and compute
    slow nothing in the simulation (``GLOO``); the host work calibrated on one rank is stretched
    by the ranks ``pin`` puts on one core (``ranks_per_core``: they take turns; the compute,
    timed on every rank at once, holds that already); and the processor work of the collectives
    (``Beside.processor_ms``, the worst rank's), of every rank on the core, is added where it
    overlaps the host's work (``IterationTimeline.work_beside_compute_ms``). With what it was made of."""
    k = ranks_per_core(world)
    stretched = [(f + k * share, b + k * share) if u is not None else (f, b) for u, (f, b) in zip(p.units, compute)]
    timeline = simulate(p, stretched, table, world, GLOO, check)
    processor = [max(r.collectives[i].processor_ms for r in ranks) for i in range(len(ranks[0].collectives))]

    def of(interval: Interval) -> float:
        unit = -1 if interval.activity is Activity.EVENT_CHECK else interval.unit
        return processor[where[(unit, interval.activity)]]

    beside = k * timeline.work_beside_compute_ms(of)
    total = sum(of(i) for i in timeline.intervals if i.activity.is_collective)
    return timeline.iteration_ms + beside, (
        f"{timeline.iteration_ms:.2f} + collectives' processor work beside the host's {beside:.2f} "
        f"(of {total:.2f} per rank, {k} rank(s) per core)"
    )


def summarize(title: str, names: list[str], rows: list[Row], repeat: int) -> None:
    """Predicted / measured per configuration (simulated + ``InStep`` fitted on the others)."""
    print(f"\n{title}: predicted = simulated + in-step costs fitted on the other configurations:")
    ratios, bare, means = [], [], []
    for name in names:
        mine = [r for r in rows if r.name == name]
        fitted = InStep.fit([r for r in rows if r.name != name])
        predictions = [r.simulated + fitted.of(r) for r in mine]
        means.append(statistics.fmean(predictions) / statistics.fmean(r.measured for r in mine))
        for row, predicted in zip(mine, predictions):
            ratios.append(predicted / row.measured)
            bare.append(row.simulated / row.measured)
            print(
                f"{name:<46} {predicted:>8.2f} / {row.measured:>8.2f} ms  {ratios[-1]:.3f}  (simulated "
                f"{row.simulated:.2f}; {fitted.per_gather_ms:.3f} ms per all-gather, "
                f"{fitted.per_reduction_ms:.3f} per reduction)"
            )
        if len(mine) > 1:
            measured = [r.measured for r in mine]
            print(f"{name:<46} measured max / min over {len(mine)} worlds: {max(measured) / min(measured):.3f}")
    everything = InStep.fit(rows)
    print(
        f"in-step costs fitted on every row: {everything.per_gather_ms:.3f} ms per all-gather, "
        f"{everything.per_reduction_ms:.3f} ms per reduction"
    )
    print(f"simulated / measured: {min(bare):.3f} - {max(bare):.3f}, median {statistics.median(bare):.3f}")
    print(f"predicted / measured: {min(ratios):.3f} - {max(ratios):.3f}, median {statistics.median(ratios):.3f}")
    print(f"within 10%: {sum(abs(r - 1) <= 0.1 for r in ratios)} of {len(ratios)}")
    if repeat > 1:
        print(
            f"within 10% of each world's measurement, a configuration's mean over its own {repeat} worlds: "
            f"{own_mean_within(rows)} of {len(rows)} (how closely this machine lets any prediction agree)"
        )
        print(
            f"per configuration, the mean prediction over its {repeat} worlds / their mean measured: "
            f"{min(means):.3f} - {max(means):.3f}, median {statistics.median(means):.3f}; within 10%: "
            f"{sum(abs(m - 1) <= 0.1 for m in means)} of {len(means)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1, help="worlds started per configuration")
    parser.add_argument(
        "--pin",
        choices=[p.value for p in Pinning],
        default=Pinning.HOST.value,
        help="which of a rank's threads stay on its core (Pinning)",
    )
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    if len(names) < 3:
        parser.error("--configs: give at least 3 (each is predicted from the others' in-step costs)")
    pinning = Pinning(args.pin)
    rows, core_rows = [], []
    for name in names:
        mine, core_mine = run(name, CONFIGS[name], args.steps, args.warmup, args.repeat, pinning)
        rows += mine
        core_rows += core_mine
    summarize("measured slowdowns (sharing_one_core)", names, rows, args.repeat)
    summarize("the core's model (core_model)", names, core_rows, args.repeat)


def own_mean_within(rows: list[Row], tolerance: float = 0.1) -> int:
    """How many rows' measured time is within ``tolerance`` of their configuration's mean
    measured time over its worlds: the agreement a prediction that knew each configuration's
    mean step time, but not which world it would run in, would reach."""
    means = {name: statistics.fmean(r.measured for r in rows if r.name == name) for name in {r.name for r in rows}}
    return sum(abs(means[r.name] / r.measured - 1) <= tolerance for r in rows)


if __name__ == "__main__":
    main()
