"""One training step against its no-overlap floor: how much the step costs beyond its parts.

Run on demand: ``python benchmarks/bench_floor.py [--rounds 15]``.

The model: 4 transformer blocks (``nn.TransformerEncoderLayer``, d_model 256, 4 heads,
feed-forward 1024) on a batch of 4 sequences of 128, one FSDP unit per block, FULL_SHARD on 2
gloo ranks, AdamW. In one world, interleaved round by round, every rank times between barriers:

- **ours**, PyTorch's **FSDP1** and **FSDP2** (``fully_shard``): one step each (forward,
  backward, optimizer step, ``zero_grad``);
- the **floor**, the step's parts one after another with nothing overlapped: one rank's compute
  alone (the same step on a plain copy of the model: forward, backward, AdamW on all its
  parameters), plus the collectives our step issues, timed alone with the runtime's own gloo
  calls (per unit: an all-gather of its flat parameter in forward and again in backward, a
  summing reduce-scatter of its gradient; the root's all-gather once), plus the end-of-backward
  event check.

Printed: each one's median step in ms, and the median over rounds of step / floor. Above 1.0 the
step costs more than its parts added up: the host's own work per hook, waiting, and whatever
overlap does not recover. Issue 36's goal for ours: at most 1.08.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_shell import FSDP
from fsdp_shell.cli.launch import run_world
from fsdp_shell.runtime.collectives import all_gather_flat, completed
from fsdp_shell.runtime.cpu import gloo_reduce_scatter

D, HEADS, FF, BLOCKS, BATCH, SEQ = 256, 4, 1024, 4, 4, 128


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True) for _ in range(BLOCKS))
    )


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    start = time.perf_counter()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _collectives(model: FSDP, rank: int, world: int) -> Callable[[], None]:
    """Our step's collectives, in its order and forms, with nothing between them."""
    group = dist.group.WORLD
    assert group is not None
    units = list(model._tree.flat_handles)
    flats = [(torch.empty(h.local.numel() * world), h.local.clone()) for h in units]
    check = (torch.empty(world, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))

    def run() -> None:
        gathers = [*flats, *flats[:-1]]  # forward, and backward again for all but the root
        for out, src in gathers:
            all_gather_flat(out, src, group)
        for out, _ in flats:
            dst = torch.empty(out.numel() // world)
            chunks = torch.empty_like(out)
            completed(functools.partial(gloo_reduce_scatter, dst, out, group, chunks), (out,))
        all_gather_flat(*check, group)

    return run


def rank_main(rank: int, world: int, rounds: int) -> dict[str, list[float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    warnings.filterwarnings("ignore", category=FutureWarning)
    block = nn.TransformerEncoderLayer
    ours = FSDP(_model(), auto_wrap_policy={block})
    fsdp1 = FullyShardedDataParallel(
        _model(), auto_wrap_policy=ModuleWrapPolicy({block}), device_id=torch.device("cpu")
    )
    fsdp2 = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in fsdp2:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp2, mesh=mesh)
    plain = _model()
    models: dict[str, nn.Module] = {"ours": ours, "fsdp1": fsdp1, "fsdp2": fsdp2, "compute": plain}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    collectives = _collectives(ours, rank, world)
    times: dict[str, list[float]] = {k: [] for k in (*models, "collectives")}
    for r in range(rounds + 3):
        x = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(1000 * r + rank))
        for name, model in models.items():
            dist.barrier()
            seconds = _step(model, opts[name], x)
            if r >= 3:
                times[name].append(seconds)
        dist.barrier()
        start = time.perf_counter()
        collectives()
        if r >= 3:
            times["collectives"].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    per_rank = run_world(2, rank_main, args.rounds, timeout=1800)
    # the slowest rank's time per round, as the step ends when the last rank's does
    t = {k: [max(r[k][i] for r in per_rank) for i in range(args.rounds)] for k in per_rank[0]}
    floor = [c + k for c, k in zip(t["compute"], t["collectives"])]

    def ms(xs: list[float]) -> float:
        return statistics.median(xs) * 1e3

    shape = f"{BLOCKS} transformer blocks (d{D}, seq {SEQ}, batch {BATCH})"
    print(f"{shape}, FULL_SHARD on 2 gloo ranks, {args.rounds} rounds")
    parts = f"compute alone {ms(t['compute']):.1f} + collectives alone {ms(t['collectives']):.1f}"
    print(f"  floor {ms(floor):7.1f} ms = {parts}")
    for name in ("ours", "fsdp1", "fsdp2"):
        ratios = sorted(s / f for s, f in zip(t[name], floor))
        q = statistics.quantiles(ratios, n=4)
        print(f"  {name:6} {ms(t[name]):7.1f} ms, {statistics.median(ratios):.2f}x the floor [{q[0]:.2f}-{q[2]:.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
