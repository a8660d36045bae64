"""Training step of fsdp_shell vs PyTorch FSDP1 and FSDP2, in one gloo world on CPU: our FSDP1
API against theirs and against FSDP2, and our ``fully_shard`` against FSDP2's.

Run on demand: ``python benchmarks/bench_training.py [--rounds 15] [--models wide,tiny,hybrid]``.

Models: "wide" (8 units of a 512-wide residual MLP layer; communication and math dominate),
"transformer" (4 pre-norm encoder blocks, d 256, 4 heads, 8 sequences of 128 tokens; run it with
``--models transformer``),
"tiny" (48 units of a few hundred parameters; per-collective latency and framework overhead
dominate), and "hybrid" (the wide model on 4 ranks as 2 replicas x 2 shards: our HYBRID_SHARD,
FSDP1's HYBRID_SHARD and FSDP2's HSDP on the same 2-D mesh).

- **Time**: the implementations train copies of the same model interleaved, one step each per
  round, every rank timing the step between barriers; reported is the median over rounds of the
  per-round ratio ours / theirs (below 1.0: ours is faster) with its interquartile range, which
  cancels most of this machine's noise. The losses of every step are compared across the three
  (identical inputs, identical initial weights): their largest difference is printed.
- **Op counts**: one more step of each, under ``torch.profiler``: how often the ops that make
  the difference ran (deterministic, unlike times).
- **Memory**: each implementation alone in a fresh world of its own, per rank: peak RSS
  (``ru_maxrss``) after the same number of steps, and the peak of live heap bytes during a
  step above what is live before it (glibc's ``mallinfo2``, sampled every 0.3 ms by a thread:
  what the step itself allocates, without the interpreter's and the allocator's baseline).
  "large" (8 units of 2048 x 2048) is measured for memory only, where the model, not the
  Python process, dominates.
- **Plans**: how many post-backward plans our runtime built and verified (each later backward
  looks its plan up by unit and carried roles), and what verifying one cost.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_core import ShardingStrategy, check_plan
from fsdp_shell import FSDP
from fsdp_shell.cli.launch import run_world


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + x


class TransformerBlock(Layer):
    """A pre-norm transformer encoder block (4 heads, MLP 4x wide, no dropout), one unit."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        del self.lin
        self.block = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block(x)
        return out


SHAPES = {
    "wide": (512, 8, 2),
    "tiny": (16, 48, 2),
    "hybrid": (512, 8, 4),
    "large": (2048, 8, 2),
    "transformer": (256, 4, 2),
}
"""model -> (width, units, ranks)."""


def _model(kind: str) -> nn.Sequential:
    width, units, _ = SHAPES[kind]
    torch.manual_seed(0)
    block = TransformerBlock if kind == "transformer" else Layer
    return nn.Sequential(*(block(width) for _ in range(units)))


def _mesh(kind: str) -> DeviceMesh | None:
    if kind != "hybrid":
        return None
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _ours(kind: str, mesh: DeviceMesh | None) -> nn.Module:
    strategy = ShardingStrategy.HYBRID_SHARD if mesh is not None else ShardingStrategy.FULL_SHARD
    return FSDP(_model(kind), auto_wrap_policy={Layer}, sharding_strategy=strategy, device_mesh=mesh)


def _fsdp1(kind: str, mesh: DeviceMesh | None) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    strategy = TorchStrategy.HYBRID_SHARD if mesh is not None else TorchStrategy.FULL_SHARD
    return FullyShardedDataParallel(
        _model(kind),
        auto_wrap_policy=ModuleWrapPolicy({Layer}),
        device_id=torch.device("cpu"),
        sharding_strategy=strategy,
        device_mesh=mesh,
    )


def _per_block(shard: Callable[..., object], kind: str, mesh: DeviceMesh | None) -> nn.Module:
    """``_model(kind)`` with ``shard`` (a ``fully_shard``) applied to every layer, then the root."""
    module = _model(kind)
    for layer in module:
        shard(layer, mesh=mesh)
    shard(module, mesh=mesh)
    return module


def _fsdp2(kind: str, mesh: DeviceMesh | None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return _per_block(fully_shard, kind, mesh)


def _ours_fully_shard(kind: str, mesh: DeviceMesh | None) -> nn.Module:
    from fsdp_shell import fully_shard

    return _per_block(fully_shard, kind, mesh)


BUILDERS: dict[str, Callable[[str, DeviceMesh | None], nn.Module]] = {
    "ours": _ours,
    "fsdp1": _fsdp1,
    "fsdp2": _fsdp2,
    "ours_fully_shard": _ours_fully_shard,
}
COUNTED = (
    "aten::fill_",
    "aten::zero_",
    "aten::add_",
    "aten::copy_",
    "aten::cat",
    "aten::slice_backward",
    "gloo:all_gather",
    "gloo:all_reduce",
    "gloo:all_to_all",
)


def _batch(kind: str, step: int, rank: int) -> torch.Tensor:
    width = SHAPES[kind][0]
    shape = (8, 128, width) if kind == "transformer" else (64, width)  # 8 sequences of 128 tokens
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * step + rank))


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach().item())


def bench(rank: int, world: int, arg: tuple[str, int]) -> dict[str, object]:
    """Per-round step times, losses and op counts of each implementation on this rank."""
    kind, rounds = arg
    torch.set_num_threads(1)
    mesh = _mesh(kind)
    models = {name: build(kind, mesh) for name, build in BUILDERS.items()}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    losses: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds + 3):
        x = _batch(kind, r, rank)
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            loss = _step(model, opts[name], x)
            dist.barrier()
            losses[name].append(loss)
            if r >= 3:
                times[name].append(time.perf_counter() - start)
    counts: dict[str, dict[str, int]] = {}
    for name, model in models.items():
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(model, opts[name], _batch(kind, rounds + 3, rank))
        seen = collections.Counter(e.name for e in prof.events())
        counts[name] = {op: seen[op] for op in COUNTED}
    ours = models["ours"]
    assert isinstance(ours, FSDP)
    cache = ours._tree.plans
    plans = [ours._tree.plans(ours._tree.settings.request(h.request)) for h in ours._flat_handles()]
    start = time.perf_counter()
    for plan in plans:
        check_plan(plan)
    verify_us = (time.perf_counter() - start) / len(plans) * 1e6
    return {"times": times, "losses": losses, "counts": counts, "plans": (cache.misses, cache.hits, verify_us)}


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_in_use() -> Callable[[], float]:
    """MiB of heap in use now (glibc: small chunks plus mmapped ones, all arenas)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2

    def in_use() -> float:
        info = libc.mallinfo2()
        return float(info.uordblks + info.hblkhd) / 2**20

    return in_use


def memory(rank: int, world: int, arg: tuple[str, str, int]) -> tuple[float, float]:
    """Peak RSS (MiB) of this rank after ``steps`` steps of one implementation alone, and the
    largest live-heap growth during one of those steps (MiB)."""
    kind, name, steps = arg
    torch.set_num_threads(1)
    in_use = _heap_in_use()
    model = BUILDERS[name](kind, _mesh(kind))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    growth = 0.0
    for step in range(steps):
        before, peak, done = in_use(), [0.0], threading.Event()

        def sample(done: threading.Event = done, peak: list[float] = peak) -> None:
            while not done.is_set():
                peak[0] = max(peak[0], in_use())
                time.sleep(0.0003)

        sampler = threading.Thread(target=sample)
        sampler.start()
        _step(model, opt, _batch(kind, step, rank))
        done.set()
        sampler.join()
        growth = max(growth, peak[0] - before)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, growth


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--models", default="wide,tiny,hybrid")
    parser.add_argument("--memory-models", default="wide,tiny,hybrid,large", help="comma-separated; none: skip")
    parser.add_argument("--memory-runs", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"gloo on CPU, {args.rounds} interleaved rounds; ratio = ours / theirs, median [IQR] of per-round ratios")
    for name, given in (("--models", args.models), ("--memory-models", args.memory_models)):
        unknown = [k for k in given.split(",") if k not in SHAPES and given != "none"]
        if unknown:
            parser.error(f"{name}: unknown model(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(SHAPES)}")
    for kind in args.models.split(","):
        ranks = SHAPES[kind][2]
        out = run_world(ranks, bench, (kind, args.rounds), timeout=1800)
        times, losses = out[0]["times"], out[0]["losses"]
        assert isinstance(times, dict) and isinstance(losses, dict)
        ours = times["ours"]
        line = [f"{kind:>6} ({ranks} ranks): ours {statistics.median(ours) * 1e3:7.2f} ms/step"]
        for other in ("fsdp1", "fsdp2"):
            lo, mid, hi = _quartiles([a / b for a, b in zip(ours, times[other])])
            line.append(f"{other} {statistics.median(times[other]) * 1e3:7.2f} ms, ratio {mid:.2f} [{lo:.2f}-{hi:.2f}]")
        print(" | ".join(line))
        mine = times["ours_fully_shard"]
        lo, mid, hi = _quartiles([a / b for a, b in zip(mine, times["fsdp2"])])
        print(
            f"{'':>8}fully_shard: ours {statistics.median(mine) * 1e3:7.2f} ms/step, "
            f"ratio to FSDP2's {mid:.2f} [{lo:.2f}-{hi:.2f}]"
        )
        rank_losses = [cast(dict[str, list[float]], per_rank["losses"]) for per_rank in out]
        pairs = (("ours", "fsdp1"), ("ours", "fsdp2"), ("ours_fully_shard", "fsdp2"))
        worst = max(abs(a - b) for lo in rank_losses for x, y in pairs for a, b in zip(lo[x], lo[y]))
        print(
            f"{'':>8}losses: largest difference, ours from FSDP1/FSDP2 and our fully_shard from FSDP2, "
            f"over {len(losses['ours'])} steps, "
            f"all ranks: {worst:.2e}"
        )
        counts = out[0]["counts"]
        assert isinstance(counts, dict)
        print(
            f"{'':>8}ops per step (rank 0): "
            + "; ".join(f"{op.split(':')[-1]} " + "/".join(str(counts[n][op]) for n in BUILDERS) for op in COUNTED)
            + "  (ours/fsdp1/fsdp2/ours fully_shard)"
        )
        misses, _, verify_us = cast(tuple[int, int, float], out[0]["plans"])
        print(
            f"{'':>8}plans: {misses} built and verified once ({verify_us:.0f} us each); each later "
            "backward looks its plan up by unit and carried roles (Tree.step_plan)"
        )
    for kind in [] if args.memory_models == "none" else args.memory_models.split(","):
        ranks = SHAPES[kind][2]
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in BUILDERS}
        for _ in range(args.memory_runs):
            for name in BUILDERS:
                per_rank = run_world(ranks, memory, (kind, name, args.memory_steps), timeout=600)
                runs[name].append((max(r for r, _ in per_rank), max(g for _, g in per_rank)))
        print(
            f"{kind:>6} memory per rank, each alone, {args.memory_steps} steps, median of {args.memory_runs} "
            "runs (worst rank): "
            + ", ".join(
                f"{n} RSS {statistics.median(r for r, _ in v):.0f} MiB, "
                f"step peak +{statistics.median(g for _, g in v):.1f} MiB"
                for n, v in runs.items()
            )
        )


if __name__ == "__main__":
    main()
