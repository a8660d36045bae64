"""The seed's table on an emulated two-node cluster: FSDP vs old (sync) HSDP vs async HSDP.

Run on demand, as root: ``python benchmarks/bench_hsdp_cluster.py [--rounds 6] [--rate 1000]
[--calibrate] [--trace DIR]``. ``--loopback`` runs the same on plain loopback (no namespaces, no rate limit)
as a smoke test.

The default link, 1000 Mbit/s, puts one block's inter-node all-reduce at about 10x its
intra-node reduce-scatter, as on the seed's cluster (30-55 ms against 3-5 ms); at 400 Mbit/s
the all-reduce is some 25x the reduce-scatter on this machine and the link alone sets the pace,
so where the all-reduce runs barely matters (measured: async/sync 0.98).

Two network namespaces joined by a rate-limited veth pair (``fsdp_shell.cluster``), two
gloo ranks per "node". A communication-bound transformer (6 encoder blocks, d_model 256,
0.79 M parameters each; a small batch, so gradient traffic over the limited link dominates)
trains one step per configuration per round, interleaved, each step timed between barriers:

- ours ``FULL_SHARD`` over all 4 ranks (its all-gathers and reduce-scatters cross the link);
- ours ``HYBRID_SHARD`` with ``hybrid_all_reduce="sync"`` (the replicate all-reduce after each
  reduce-scatter, as FSDP1 before PyTorch PR 106080) and ``"async"`` (the default);
- PyTorch FSDP1 ``HYBRID_SHARD`` and ``FULL_SHARD`` on the same cluster.

Shard groups are the two ranks of one node, replicate groups span the nodes. Printed: median
ms/iteration (with the interquartile range over rounds, worst rank) and the seed's ratios
(async vs sync, async vs FSDP, async vs FSDP1's HSDP). With ``--trace DIR``, one more
``FULL_SHARD``, sync and async iteration each run under ``torch.profiler`` (every thread; the
profiler slows them by a third or more) and every rank writes a Perfetto-readable trace
(``DIR/<config>-rank<r>.json``).

``--calibrate`` then predicts our three configurations with the iteration simulator
(``fsdp_core.simulate_iteration``) from timings taken on the same cluster, none fitted to an
iteration time (``hsdp_cluster_calibrate.calibrate``; every number a mean over repeats and over
the four ranks):

- every collective FSDP issues, alone, at two sizes, as the runtime issues it
  (``model_from_measurements`` fits latency + bytes / bandwidth to them);
- each block's forward and backward compute inside training (the mean rank's, and the slowest
  rank's in each step: both predictions are printed);
- how the processor shared by four ranks on two cores slows collectives
  (``links_from_measurements``): each collective beside every rank's compute (the
  ``LinkModel.compute_slowdown`` of each collective: measured 1.2x to 5x), the intra-node ones
  beside an inter-node all-reduce (``cross_link_slowdown``; about 1.0-1.2x, and the all-reduce
  beside intra-node traffic not slowed, so the model slows only the intra-node side), and the
  all-gather and reduce-scatter of one group issued together, as gloo runs them side by side
  (``contention``, about 1.1);
- what the timed step does outside the simulated iteration (the input, the optimizer step,
  ``zero_grad``, the closing barrier), added to each prediction.

It prints them, the simulated and measured ms/iteration and their ratio; with ``--trace`` it also
writes ``calibration.json`` and each simulated iteration as a chart and a Perfetto trace
(``DIR/simulated-<config>.{txt,json}``) beside the profiled ones. See docs/async-hsdp.md for what
it predicts and what the model still leaves out.

This file is the command line; its parts sit beside it: ``hsdp_cluster_seed.py`` (the model,
the configurations, the timed steps and the table), ``hsdp_cluster_calibrate.py`` (what each
rank times for the simulator) and ``hsdp_cluster_predict.py`` (the simulated iterations, printed
and written).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import hsdp_cluster_predict, hsdp_cluster_seed
from benchmarks.hsdp_cluster_calibrate import REPEATS, Spans, calibrate
from benchmarks.hsdp_cluster_seed import BLOCKS, seed_table
from fsdp_core.sim import Measurements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rate", type=float, default=1000.0, help="inter-node link, Mbit/s (default 1000)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument(
        "--trace",
        default=None,
        help="write per-rank Perfetto traces of one FULL_SHARD, sync and async step "
        "(with --calibrate also the simulated ones)",
    )
    parser.add_argument("--loopback", action="store_true", help="plain loopback, no emulated link (smoke test)")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="also time every collective alone and each unit's compute, and print what the "
        "iteration simulator (fsdp_core.simulate_iteration) predicts beside the measurements",
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    trace = None if args.trace is None else str(Path(args.trace).resolve())
    if trace is not None:
        Path(trace).mkdir(parents=True, exist_ok=True)
    shape = (args.batch, args.seq)
    arg = (args.rounds, args.warmup, trace, shape)
    run: Callable[[Callable[[int, int, object], object], object], list[object]]
    if args.loopback:
        from fsdp_shell.cli.launch import run_world

        run = lambda fn, a: run_world(4, fn, a, timeout=3600)  # noqa: E731
        where = "plain loopback, 4 ranks"
    else:
        from fsdp_shell.cluster import cluster_available, run_on_cluster

        reason = cluster_available()
        if reason is not None:
            sys.exit(f"bench_hsdp_cluster: {reason}")
        run = lambda fn, a: run_on_cluster(fn, a, rate_mbit=args.rate, ranks_per_node=2, timeout=3600)  # noqa: E731
        where = f"2 nodes x 2 ranks, {args.rate:g} Mbit/s between the nodes"
    print(
        f"{where}; {BLOCKS} encoder blocks of 0.79 M parameters, batch {args.batch} x {args.seq}; "
        f"{args.rounds} interleaved rounds after {args.warmup} warm-up; median of per-round worst-rank times"
    )
    measured = hsdp_cluster_seed.report(run(seed_table, arg), args.rounds)  # type: ignore[arg-type]
    if args.calibrate:
        per_rank = cast(list[tuple[Measurements, float, Spans]], run(calibrate, (REPEATS, shape)))  # type: ignore[arg-type]
        hsdp_cluster_predict.report(per_rank, measured, None if trace is None else Path(trace))
    if trace is not None:
        print(
            f"  traces: {trace}/ours-{{full,hybrid-sync,hybrid-async}}-rank<r>.json (open in ui.perfetto.dev)"
            + (
                f"; simulated: {trace}/simulated-<config>.{{txt,json}}, {trace}/calibration.json"
                if args.calibrate
                else ""
            )
        )


if __name__ == "__main__":
    main()
