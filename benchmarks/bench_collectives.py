"""Gloo reduce-scatter, three ways, and all-gather, two ways, on loopback: what
``fsdp_shell.runtime.cpu`` chooses from (``fsdp_core.execution``'s ``scatter_form`` and
``gather_by_broadcasts``).

Run on demand: ``python benchmarks/bench_collectives.py [--nproc 2] [--gather]``.

With ``--gather``, all-gathers of outputs from 2 KiB to 12 MiB: ``all_gather`` (gloo's
``all_gather_single``, which gathers through a buffer of its own) and ``broadcasts`` (one
broadcast per rank into its slice of the output, ``broadcast_gather``).

- ``torch``: ``reduce_scatter_tensor``, which gloo does not have natively (torch emulates it);
- ``all_reduce``: an in-place all-reduce of the input and a copy of this rank's chunk (twice the
  bytes of a reduce-scatter, no buffer beyond input and output);
- ``all_to_all``: every rank sends each other rank its chunk (the bytes of a ring
  reduce-scatter) into a receive buffer the size of the input, then sums the chunks locally.

Each is timed asynchronously issued and waited, interleaved over rounds; reported is the
median per call in microseconds, per input size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_shell.cli.launch import run_world
from fsdp_shell.runtime.collectives import all_gather_flat, broadcast_gather

SIZES = (544, 65_536, 1 << 20, 4 << 20)


def _ways(src: torch.Tensor, dst: torch.Tensor, world: int, rank: int) -> dict[str, Callable[[], None]]:
    chunks = torch.empty_like(src)

    def torch_rs() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            work = dist.reduce_scatter_tensor(dst, src, async_op=True)
        assert work is not None
        work.wait()

    def all_reduce() -> None:
        work = dist.all_reduce(src, async_op=True)
        assert work is not None
        work.wait()
        dst.copy_(src.narrow(0, rank * dst.numel(), dst.numel()))

    def all_to_all() -> None:
        work = dist.all_to_all_single(chunks, src, async_op=True)
        assert work is not None
        work.wait()
        torch.sum(chunks.view(world, -1), dim=0, out=dst)

    return {"torch": torch_rs, "all_reduce": all_reduce, "all_to_all": all_to_all}


GATHER_SIZES = (512, 16_384, 262_144, 524_288, 1_048_576, 3_145_728)
"""All-gather output elements (fp32): 2 KiB to 12 MiB."""


def _gather_ways(src: torch.Tensor, dst: torch.Tensor, world: int, rank: int) -> dict[str, Callable[[], None]]:
    group = dist.group.WORLD
    assert group is not None

    def all_gather() -> None:
        all_gather_flat(dst, src, group)

    def broadcasts() -> None:
        broadcast_gather(dst, src, group).wait()

    return {"all_gather": all_gather, "broadcasts": broadcasts}


def bench(rank: int, world: int, arg: tuple[int, bool]) -> dict[tuple[str, int], float]:
    rounds, gather = arg
    torch.set_num_threads(1)
    out: dict[tuple[str, int], list[float]] = {}
    for n in GATHER_SIZES if gather else SIZES:
        if gather:
            src, dst = torch.randn(n // world), torch.empty(n)
            ways = _gather_ways(src, dst, world, rank)
        else:
            src, dst = torch.randn(n), torch.empty(n // world)
            ways = _ways(src, dst, world, rank)
        calls = 50 if n < 100_000 else 10
        for _ in range(rounds):
            for name, fn in ways.items():
                fn()
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                out.setdefault((name, n), []).append((time.perf_counter() - start) / calls * 1e6)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gather", action="store_true", help="all-gather forms instead of reduce-scatter forms")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = run_world(args.nproc, bench, (args.rounds, args.gather), timeout=900)[0]
    if args.gather:
        print(f"gloo all-gather on {args.nproc} ranks, median us per call over {args.rounds} interleaved rounds")
        print(f"{'out bytes':>10} {'all_gather':>11} {'broadcasts':>11} {'ratio':>6}")
        for n in GATHER_SIZES:
            a, b = result[("all_gather", n)], result[("broadcasts", n)]
            print(f"{4 * n:>10} {a:>11.0f} {b:>11.0f} {b / a:>6.2f}")
        return
    print(f"gloo reduce-scatter on {args.nproc} ranks, median us per call over {args.rounds} interleaved rounds")
    print(f"{'elements':>10} " + " ".join(f"{w:>11}" for w in ("torch", "all_reduce", "all_to_all")))
    for n in SIZES:
        print(f"{n:>10} " + " ".join(f"{result[(w, n)]:>11.0f}" for w in ("torch", "all_reduce", "all_to_all")))


if __name__ == "__main__":
    main()
