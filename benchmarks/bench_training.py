"""Training-step time of fsdp_shell vs PyTorch FSDP1 and FSDP2, in one gloo world on CPU.

Run on demand: ``python benchmarks/bench_training.py [--nproc 2] [--rounds 15]``.

Two models: a "wide" MLP stack (communication and math dominate) and "tiny", 48 units of a
few hundred parameters each (framework overhead dominates). The three implementations train
copies of the same model interleaved, one step each per round, every rank timing the step
between barriers; the report is the median over rounds of the per-round ratio
ours / theirs (below 1.0: ours is faster), which cancels most of this machine's noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_shell import FSDP  # noqa: E402
from tests.dist_harness import run_world  # noqa: E402


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + x


def _model(kind: str) -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    if kind == "wide":
        return nn.Sequential(*(Layer(512) for _ in range(8))), 512
    return nn.Sequential(*(Layer(16) for _ in range(48))), 16


def _ours(kind: str) -> nn.Module:
    module, _ = _model(kind)
    return FSDP(module, auto_wrap_policy={Layer})


def _fsdp1(kind: str) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    module, _ = _model(kind)
    return FullyShardedDataParallel(module, auto_wrap_policy=ModuleWrapPolicy({Layer}), device_id=torch.device("cpu"))


def _fsdp2(kind: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    module, _ = _model(kind)
    for layer in module:
        fully_shard(layer)
    fully_shard(module)
    return module


BUILDERS: dict[str, Callable[[str], nn.Module]] = {"ours": _ours, "fsdp1": _fsdp1, "fsdp2": _fsdp2}


def bench(rank: int, world: int, arg: tuple[str, int]) -> dict[str, list[float]]:
    """Per-round step times of each implementation on this rank."""
    kind, rounds = arg
    torch.set_num_threads(1)
    _, width = _model(kind)
    models = {name: build(kind) for name, build in BUILDERS.items()}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    x = torch.randn(64, width)
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds + 3):
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            model(x).square().mean().backward()
            opts[name].step()
            opts[name].zero_grad()
            dist.barrier()
            if r >= 3:
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"gloo world of {args.nproc} on CPU, {args.rounds} interleaved rounds; ratio = ours / theirs (median)")
    for kind in ("wide", "tiny"):
        times = run_world(args.nproc, bench, (kind, args.rounds), timeout=900)[0]
        ours = times["ours"]
        line = [f"{kind:>5}: ours {statistics.median(ours) * 1e3:7.2f} ms/step"]
        for other in ("fsdp1", "fsdp2"):
            ratios = [a / b for a, b in zip(ours, times[other])]
            line.append(f"{other} {statistics.median(times[other]) * 1e3:7.2f} ms, ratio {statistics.median(ratios):.2f}")
        print(" | ".join(line))


if __name__ == "__main__":
    main()
