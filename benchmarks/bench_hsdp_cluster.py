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


def _report(per_rank: list[dict[str, list[float]]], rounds: int) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rate", type=float, default=1000.0, help="inter-node link, Mbit/s (default 1000)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--trace", default=None, help="write per-rank Perfetto traces of one sync and one async step")
    parser.add_argument("--loopback", action="store_true", help="plain loopback, no emulated link (smoke test)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    trace = None if args.trace is None else str(Path(args.trace).resolve())
    if trace is not None:
        Path(trace).mkdir(parents=True, exist_ok=True)
    arg = (args.rounds, args.warmup, trace, (args.batch, args.seq))
    run: Callable[[], list[dict[str, list[float]]]]
    if args.loopback:
        from tests.dist_harness import run_world

        run = lambda: run_world(4, seed_table, arg, timeout=3600)  # noqa: E731
        where = "plain loopback, 4 ranks"
    else:
        from benchmarks.cluster import cluster_available, run_on_cluster

        reason = cluster_available()
        if reason is not None:
            sys.exit(f"bench_hsdp_cluster: {reason}")
        run = lambda: run_on_cluster(seed_table, arg, rate_mbit=args.rate, ranks_per_node=2, timeout=3600)  # noqa: E731
        where = f"2 nodes x 2 ranks, {args.rate:g} Mbit/s between the nodes"
    print(f"{where}; {BLOCKS} encoder blocks of 0.79 M parameters, batch {args.batch} x {args.seq}; "
          f"{args.rounds} interleaved rounds after {args.warmup} warm-up; median of per-round worst-rank times")
    _report(run(), args.rounds)
    if trace is not None:
        print(f"  traces: {trace}/ours-hybrid-{{sync,async}}-rank<r>.json (open in ui.perfetto.dev)")


if __name__ == "__main__":
    main()
