"""HSDP cluster benchmark, its seed table: the model, the five configurations, each rank's
interleaved step times and the table printed from them
(``benchmarks/bench_hsdp_cluster.py``'s docstring says what and why)."""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_core import ShardingStrategy
from fsdp_shell import FSDP

D_MODEL, HEADS, FF, BLOCKS = 256, 4, 1024, 6

CONFIGS = ("fsdp1-full", "ours-full", "fsdp1-hybrid", "ours-hybrid-sync", "ours-hybrid-async")


class Model(nn.Module):
    """Embedding-free transformer: an input projection, ``BLOCKS`` encoder layers, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, D_MODEL)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True) for _ in range(BLOCKS)
        )
        self.head = nn.Linear(D_MODEL, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def build(config: str, mesh: DeviceMesh) -> nn.Module:
    """``Model`` (seeded, so every configuration starts from the same weights) wrapped as
    ``config`` of ``CONFIGS`` says; ``mesh``: (replicate, shard), the hybrid ones' groups."""
    torch.manual_seed(0)
    module = Model()
    if config.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        hybrid = config.endswith("hybrid")
        return FullyShardedDataParallel(
            module,
            auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}),
            device_id=torch.device("cpu"),
            sharding_strategy=TorchStrategy.HYBRID_SHARD if hybrid else TorchStrategy.FULL_SHARD,
            device_mesh=mesh if hybrid else None,
        )
    if config == "ours-full":
        return FSDP(module, auto_wrap_policy={nn.TransformerEncoderLayer})
    placement = config.rsplit("-", 1)[1]
    return FSDP(
        module,
        auto_wrap_policy={nn.TransformerEncoderLayer},
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_mesh=mesh,
        hybrid_all_reduce=placement,
    )


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, shape: tuple[int, int]) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(*shape, 32, generator=g), torch.randn(*shape, 1, generator=g)
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach().item())


def seed_table(rank: int, world: int, arg: tuple[int, int, str | None, tuple[int, int]]) -> dict[str, list[float]]:
    """Per-round step times (s) of every configuration on this rank, interleaved; with a trace
    directory, one profiled sync and async iteration each. ``shape``: (batch, sequence)."""
    rounds, warmup, trace_dir, shape = arg
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    models = {c: build(c, mesh) for c in CONFIGS}
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
        for config in ("ours-full", "ours-hybrid-sync", "ours-hybrid-async"):
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
                _step(models[config], opts[config], warmup + rounds, rank, shape)
            prof.export_chrome_trace(str(Path(trace_dir) / f"{config}-rank{rank}.json"))
    del models, opts
    gc.collect()
    return times


def report(per_rank: list[dict[str, list[float]]], rounds: int) -> dict[str, float]:
    """Print the table from every rank's ``seed_table`` (in rank order): each configuration's
    median over rounds of the worst rank's ms/iteration with its interquartile range, and the
    seed's ratios (medians of the per-round ratios); return the medians."""
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
