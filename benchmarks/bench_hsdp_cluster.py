"""The seed's table on an emulated two-node cluster: FSDP vs old (sync) HSDP vs async HSDP.

Run on demand, as root: ``python benchmarks/bench_hsdp_cluster.py [--rounds 6] [--rate 1000]
[--trace DIR]``. ``--loopback`` runs the same on plain loopback (no namespaces, no rate limit)
as a smoke test.

The default link, 1000 Mbit/s, puts one block's inter-node all-reduce at about 10x its
intra-node reduce-scatter, as on the seed's cluster (30-55 ms against 3-5 ms); at 400 Mbit/s
the all-reduce is some 25x the reduce-scatter on this machine and the link alone sets the pace,
so where the all-reduce runs barely matters (measured: async/sync 0.98).

Two network namespaces joined by a rate-limited veth pair (``benchmarks/cluster.py``), two
gloo ranks per "node". A communication-bound transformer (6 encoder blocks, d_model 256,
0.79 M parameters each; a small batch, so gradient traffic over the limited link dominates)
trains one step per configuration per round, interleaved, each step timed between barriers:

- ours ``FULL_SHARD`` over all 4 ranks (its all-gathers and reduce-scatters cross the link);
- ours ``HYBRID_SHARD`` with ``hybrid_all_reduce="sync"`` (the replicate all-reduce after each
  reduce-scatter, as FSDP1 before PyTorch PR 106080) and ``"async"`` (the default);
- PyTorch FSDP1 ``HYBRID_SHARD`` and ``FULL_SHARD`` on the same cluster.

Shard groups are the two ranks of one node, replicate groups span the nodes. Printed: median
ms/iteration (with the interquartile range over rounds, worst rank) and the seed's ratios
(async vs sync, async vs FSDP, async vs FSDP1's HSDP). With ``--trace DIR``, one more sync and
one async iteration run under ``torch.profiler`` and every rank writes a Perfetto-readable
trace (``DIR/<config>-rank<r>.json``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_core import ShardingStrategy  # noqa: E402
from fsdp_shell import FSDP  # noqa: E402

D_MODEL, HEADS, FF, BLOCKS = 256, 4, 1024, 6

CONFIGS = ("fsdp1-full", "ours-full", "fsdp1-hybrid", "ours-hybrid-sync", "ours-hybrid-async")


class Model(nn.Module):
    """Embedding-free transformer: an input projection, ``BLOCKS`` encoder layers, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, D_MODEL)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True) for _ in range(BLOCKS))
        self.head = nn.Linear(D_MODEL, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def _build(config: str, mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    module = Model()
    if config.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy as TorchStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        hybrid = config.endswith("hybrid")
        return FullyShardedDataParallel(
            module, auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}), device_id=torch.device("cpu"),
            sharding_strategy=TorchStrategy.HYBRID_SHARD if hybrid else TorchStrategy.FULL_SHARD,
            device_mesh=mesh if hybrid else None)
    if config == "ours-full":
        return FSDP(module, auto_wrap_policy={nn.TransformerEncoderLayer})
    placement = config.rsplit("-", 1)[1]
    return FSDP(module, auto_wrap_policy={nn.TransformerEncoderLayer}, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                device_mesh=mesh, hybrid_all_reduce=placement)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, shape: tuple[int, int]) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(*shape, 32, generator=g), torch.randn(*shape, 1, generator=g)
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach().item()


def seed_table(rank: int, world: int, arg: tuple[int, int, str | None, tuple[int, int]]) -> dict[str, list[float]]:
    """Per-round step times (s) of every configuration on this rank, interleaved; with a trace
    directory, one profiled sync and async iteration each. ``shape``: (batch, sequence)."""
    rounds, warmup, trace_dir, shape = arg
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    models = {c: _build(c, mesh) for c in CONFIGS}
    opts = {c: torch.optim.SGD(m.parameters(), lr=1e-3) for c, m in models.items()}
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for r in range(warmup + rounds):
        for config, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            _step(model, opts[config], r, rank, shape)
            dist.barrier()
            if r >= warmup:
                times[config].append(time.perf_counter() - start)
    if trace_dir is not None:
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerActivity, profile

        every_thread = _ExperimentalConfig(profile_all_threads=True)  # the lane issues the all-reduces
        for config in ("ours-hybrid-sync", "ours-hybrid-async"):
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
                _step(models[config], opts[config], warmup + rounds, rank, shape)
            prof.export_chrome_trace(str(Path(trace_dir) / f"{config}-rank{rank}.json"))
    del models, opts
    gc.collect()
    return times


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def calibrate(rank: int, world: int, arg: tuple[int, tuple[int, int]]) -> tuple[list[tuple[str, str, int, float]],
                                                                              list[tuple[str, int, float, float]]]:
    """What the simulator needs, timed on this cluster: every collective FSDP issues, alone, at
    two sizes (a block's flat parameter and a quarter of it), as the runtime issues it (gloo
    reduce-scatters as ``collectives.gloo_reduce_scatter``); and each unit's forward and
    backward compute on one rank. Returns (collective, link, bytes, ms) and (unit, bytes,
    forward ms, backward ms)."""
    from fsdp_shell.collectives import all_gather_flat, gloo_reduce_scatter

    repeats, shape = arg
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    groups = {"intra_node": mesh.get_group(1), "inter_node": dist.group.WORLD}
    replicate = mesh.get_group(0)
    block_numel = sum(p.numel() for p in nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, batch_first=True).parameters())
    samples = []
    for numel in (block_numel, block_numel // 4):
        for link, group in groups.items():
            assert isinstance(group, dist.ProcessGroup)
            size = group.size()
            padded = -(-numel // size) * size
            full, shard = torch.randn(padded), torch.randn(padded // size)

            def gather() -> None:
                work = all_gather_flat(full, shard, group, async_op=True)
                assert work is not None
                work.wait()

            samples.append(("all_gather", link, padded * 4, _median_ms(gather, repeats)))
            samples.append(("reduce_scatter", link, padded * 4, _median_ms(
                lambda: gloo_reduce_scatter(torch.empty(padded // size), full, group, may_overwrite_src=False)(),
                repeats)))
        part = torch.randn(-(-numel // 2))
        samples.append(("all_reduce", "inter_node", part.numel() * 4, _median_ms(
            lambda: dist.all_reduce(part, group=replicate), repeats)))
    return samples, _unit_compute(_build("ours-hybrid-async", mesh), repeats, shape, rank)


def _unit_compute(model: nn.Module, steps: int, shape: tuple[int, int], rank: int) -> list[tuple[str, int, float, float]]:
    """Each unit's forward and backward compute as it runs inside training on this cluster
    (so with the other ranks' compute and the collectives competing for the cores): wall time
    inside each block's forward and from its output's gradient to its input's, medians over
    ``steps`` steps; the root is what the step takes outside the blocks' forwards."""
    blocks = [m for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    marks: dict[tuple[int, str], list[float]] = {}

    def mark(i: int, what: str) -> Callable[..., None]:
        return lambda *_: marks.setdefault((i, what), []).append(time.perf_counter())

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(mark(i, "f0"))
        block.register_forward_hook(mark(i, "f1"))
        block.register_full_backward_pre_hook(mark(i, "b0"))
        block.register_full_backward_hook(mark(i, "b1"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(steps):
        _step(model, opt, step, rank, shape)

    def span(i: int, a: str, b: str) -> float:
        return statistics.median(e - s for s, e in zip(marks[(i, a)], marks[(i, b)])) * 1e3

    numel = sum(p.numel() for p in nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, batch_first=True).parameters())
    root_numel = (32 + 1) * D_MODEL + D_MODEL + 1
    return [("root", root_numel * 4, 0.0, 0.0)] + [
        (f"block{i}", numel * 4, span(i, "f0", "f1"), span(i, "b0", "b1")) for i in range(len(blocks))]


def _predict(samples: list[tuple[str, str, int, float]], units: list[tuple[str, int, float, float]]) -> dict[str, float]:
    """Simulated ms/iteration of our three configurations from the calibration."""
    from fsdp_core import (Collective, CollectiveSample, Link, MeasuredUnit, Measurements, Schedule,
                           model_from_measurements, simulate_iteration)

    measured = Measurements(
        units=tuple(MeasuredUnit(name=n, param_bytes=b, forward_ms=f, backward_ms=bw) for n, b, f, bw in units),
        samples=tuple(CollectiveSample(collective=Collective(c), link=Link(link), nbytes=b, ms=ms)
                      for c, link, b, ms in samples),
        ranks_per_node=2,
    )
    model = model_from_measurements(measured)
    return {config: simulate_iteration(model, schedule).iteration_ms for config, schedule in
            (("ours-full", Schedule.FSDP), ("ours-hybrid-sync", Schedule.HSDP_SYNC),
             ("ours-hybrid-async", Schedule.HSDP_ASYNC))}


def _report(per_rank: list[dict[str, list[float]]], rounds: int) -> dict[str, float]:
    worst = {c: [max(r[c][i] for r in per_rank) * 1e3 for i in range(rounds)] for c in CONFIGS}
    med = {c: statistics.median(v) for c, v in worst.items()}
    for c in CONFIGS:
        q = statistics.quantiles(worst[c], n=4) if rounds > 1 else [med[c], med[c], med[c]]
        print(f"  {c:<18} {med[c]:8.1f} ms/iter  [IQR {q[0]:.0f}-{q[2]:.0f}]")

    def ratio(a: str, b: str) -> str:
        per_round = [x / y for x, y in zip(worst[a], worst[b])]
        return f"{statistics.median(per_round):.2f}"

    print(f"  async / sync HSDP (ours): {ratio('ours-hybrid-async', 'ours-hybrid-sync')}   (seed: 597/665 = 0.90)")
    print(f"  async HSDP / FSDP (ours): {ratio('ours-hybrid-async', 'ours-full')}   (seed: 597/1160 = 0.51)")
    print(f"  async HSDP / FSDP1 HSDP:  {ratio('ours-hybrid-async', 'fsdp1-hybrid')}")
    print(f"  sync HSDP / FSDP1 HSDP:   {ratio('ours-hybrid-sync', 'fsdp1-hybrid')}")
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rate", type=float, default=1000.0, help="inter-node link, Mbit/s (default 1000)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--trace", default=None, help="write per-rank Perfetto traces of one sync and one async step")
    parser.add_argument("--loopback", action="store_true", help="plain loopback, no emulated link (smoke test)")
    parser.add_argument("--calibrate", action="store_true",
                        help="also time every collective alone and each unit's compute, and print what the "
                             "iteration simulator (fsdp_core.simulate_iteration) predicts beside the measurements")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    trace = None if args.trace is None else str(Path(args.trace).resolve())
    if trace is not None:
        Path(trace).mkdir(parents=True, exist_ok=True)
    shape = (args.batch, args.seq)
    arg = (args.rounds, args.warmup, trace, shape)
    run: Callable[[Callable[[int, int, object], object], object], list[object]]
    if args.loopback:
        from tests.dist_harness import run_world

        run = lambda fn, a: run_world(4, fn, a, timeout=3600)  # noqa: E731
        where = "plain loopback, 4 ranks"
    else:
        from benchmarks.cluster import cluster_available, run_on_cluster

        reason = cluster_available()
        if reason is not None:
            sys.exit(f"bench_hsdp_cluster: {reason}")
        run = lambda fn, a: run_on_cluster(fn, a, rate_mbit=args.rate, ranks_per_node=2, timeout=3600)  # noqa: E731
        where = f"2 nodes x 2 ranks, {args.rate:g} Mbit/s between the nodes"
    print(f"{where}; {BLOCKS} encoder blocks of 0.79 M parameters, batch {args.batch} x {args.seq}; "
          f"{args.rounds} interleaved rounds after {args.warmup} warm-up; median of per-round worst-rank times")
    measured = _report(run(seed_table, arg), args.rounds)  # type: ignore[arg-type]
    if args.calibrate:
        samples, units = run(calibrate, (9, shape))[0]  # type: ignore[arg-type,misc]
        print("  calibration (rank 0, each alone, median of 9): " + "; ".join(
            f"{c} {link} {b / 2**20:.2f} MiB {ms:.1f} ms" for c, link, b, ms in samples))
        print("  compute per unit (fwd/bwd ms): " + ", ".join(f"{n} {f:.1f}/{bw:.1f}" for n, _, f, bw in units))
        predicted = _predict(samples, units)
        for config, ms in predicted.items():
            print(f"  simulated {config:<18} {ms:8.1f} ms/iter   measured {measured[config]:8.1f}   "
                  f"simulated/measured {ms / measured[config]:.2f}")
    if trace is not None:
        print(f"  traces: {trace}/ours-hybrid-{{sync,async}}-rank<r>.json (open in ui.perfetto.dev)")


if __name__ == "__main__":
    main()
