"""Training step at world size 1 on one device: our FSDP1 API and our ``fully_shard`` against
PyTorch's FSDP1 and FSDP2, on ``bench_training.py``'s wide and many-tiny-units models.

Run on demand: ``python benchmarks/bench_gpu_step.py [--device cuda] [--rounds 30]``
(``scripts/gpu_check.sh`` runs it on the lent GPU). On a GPU the host's time per hook is what
limits FSDP at small sizes, which no CPU figure shows; ``--device cpu`` (gloo) runs the same code
here.

The four train copies of the same model interleaved, one step each per round, each step timed
from the host until the device is done with it (``synchronize``). Reported: the median step time
of each and the median over rounds of the per-round ratio ours / theirs with its interquartile
range, and the largest difference of the losses across the four (identical inputs and weights).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_training import SHAPES, Layer
from fsdp_shell.cli.launch import run_world

IMPLS = ("ours", "fsdp1", "fsdp2", "ours_fully_shard")


def _model(kind: str, device: torch.device) -> nn.Sequential:
    width, units, _ = SHAPES[kind]
    torch.manual_seed(0)
    return nn.Sequential(*(Layer(width) for _ in range(units))).to(device)


def _build(impl: str, kind: str, device: torch.device) -> nn.Module:
    module = _model(kind, device)
    if impl == "ours":
        from fsdp_shell import FSDP

        return FSDP(module, auto_wrap_policy={Layer}, device_id=device)
    if impl == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(module, auto_wrap_policy=ModuleWrapPolicy({Layer}), device_id=device)
    shard: Callable[..., object]
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard as shard
    else:
        from fsdp_shell import fully_shard as shard
    for layer in module:
        shard(layer)
    shard(module)
    return module


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def bench(rank: int, world: int, arg: tuple[str, str, int]) -> dict[str, tuple[list[float], list[float]]]:
    """Per-round step seconds and losses of each implementation."""
    kind, device_type, rounds = arg
    device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
    if device.type != "cpu":
        torch.accelerator.set_device_index(0)
    torch.set_num_threads(1)
    models = {impl: _build(impl, kind, device) for impl in IMPLS}
    opts = {impl: torch.optim.SGD(m.parameters(), lr=1e-9) for impl, m in models.items()}  # "tiny" stays finite
    width = SHAPES[kind][0]
    out: dict[str, tuple[list[float], list[float]]] = {impl: ([], []) for impl in IMPLS}
    for r in range(rounds + 3):
        x = (0.1 * torch.randn(64, width, generator=torch.Generator().manual_seed(r))).to(device)
        for impl, model in models.items():
            _sync(device)
            start = time.perf_counter()
            loss = model(x).square().mean()
            loss.backward()
            opts[impl].step()
            opts[impl].zero_grad()
            _sync(device)
            elapsed = time.perf_counter() - start
            if r >= 3:
                out[impl][0].append(elapsed)
                out[impl][1].append(float(loss.detach()))
    dist.barrier()
    return out


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--models", default="wide,tiny")
    args = parser.parse_args()
    if args.device != "cpu" and not torch.accelerator.is_available():
        parser.error(f"--device {args.device}: no accelerator here; pass --device cpu")
    backend = "gloo" if args.device == "cpu" else "nccl"
    for kind in args.models.split(","):
        if kind not in SHAPES:
            parser.error(f"--models: unknown model {kind!r}; accepted: {', '.join(SHAPES)}")
        result = run_world(1, bench, (kind, args.device, args.rounds), timeout=900, backend=backend)[0]
        times = {impl: result[impl][0] for impl in IMPLS}
        losses = [result[impl][1] for impl in IMPLS]
        worst = max(abs(a - b) for step in zip(*losses) for a in step for b in step)
        medians = ", ".join(f"{impl} {statistics.median(times[impl]) * 1e3:.2f} ms" for impl in IMPLS)
        ratios = []
        for mine, theirs in (("ours", "fsdp1"), ("ours", "fsdp2"), ("ours_fully_shard", "fsdp2")):
            lo, mid, hi = _quartiles([a / b for a, b in zip(times[mine], times[theirs])])
            ratios.append(f"{mine}/{theirs} {mid:.2f} [{lo:.2f}-{hi:.2f}]")
        print(
            f"{kind} on {args.device}, world size 1, {args.rounds} rounds: {medians}; {'; '.join(ratios)}; "
            f"losses differ by at most {worst:.1e}"
        )


if __name__ == "__main__":
    main()
