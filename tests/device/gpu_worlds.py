"""The sharded and hybrid paths on one GPU: worlds of 2 and 4 gloo ranks that all use device 0,
training the cases of ``test_fsdp_gloo`` on the accelerator runtime with real device streams,
against the single-process reference; then again with ~20 ms of sleep enqueued before every op
on one side stream, so the other streams run ahead and reuse freed memory as early as the
caching allocator lets them. NCCL refuses two ranks on one device, so gloo carries the
collectives (over device tensors); the first line says which collectives gloo lacks for them.

    python -m tests.device.gpu_worlds            # on a GPU (scripts/gpu_check.sh)
    python -m tests.device.gpu_worlds --device cpu --quick   # the same code path on the CPU runtime

Prints one summary line per part; exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fsdp_core import Stream
from fsdp_shell.runtime.accelerator import AcceleratorRuntime
from fsdp_shell.runtime.collectives import all_gather_flat, reduce_scatter_flat
from tests.worlds.dist_harness import run_world
from tests.worlds.fsdp_cases import Case, check_outcomes, run_case
from tests.worlds.test_fsdp_gloo import FLAT_CASES, HYBRID_CASES
from tests.worlds.test_fully_shard_gloo import CASES as FULLY_SHARD_CASES
from tests.worlds.test_fully_shard_gloo import Case as FullyShardCase
from tests.worlds.test_fully_shard_gloo import train_against_fsdp2

COLLECTIVES: dict[str, Callable[[torch.Tensor, int], object]] = {
    "all_reduce": lambda t, world: dist.all_reduce(t),
    "all_gather_into_tensor": lambda t, world: all_gather_flat(t.new_empty(world * t.numel()), t, None),  # type: ignore[arg-type]  # None: the default group
    "reduce_scatter_tensor": lambda t, world: reduce_scatter_flat(t[: t.numel() // world], t, None),  # type: ignore[arg-type]  # None: the default group
    "all_to_all_single": lambda t, world: dist.all_to_all_single(torch.empty_like(t), t),
}


def probe(rank: int, world: int, device: str) -> list[str]:
    """The collectives gloo does not run on ``device`` tensors here."""
    lacking = []
    for name, call in COLLECTIVES.items():
        try:
            call(torch.ones(4 * world, device=_device(device)), world)
        except RuntimeError:
            lacking.append(name)
    return lacking


def _device(device: str) -> torch.device:
    return torch.device("cpu") if device == "cpu" else torch.device(device, 0)


@contextlib.contextmanager
def slowed(stream: Stream | None) -> Iterator[None]:
    """Every ``AcceleratorRuntime`` enqueues ~20 ms of sleep on ``stream`` before each op there."""
    if stream is None or not torch.cuda.is_available():
        yield
        return
    saved = {
        name: getattr(AcceleratorRuntime, name) for name in ("compute", "reduce_scatter", "all_reduce", "comm_hook")
    }

    def slowed(method: Callable[..., None]) -> Callable[..., None]:
        def run(self: AcceleratorRuntime[Any, Any], on: Stream, *args: Any, **kwargs: Any) -> None:
            if on is stream:
                with self.streams[stream]:
                    torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]  # unannotated in torch
            method(self, on, *args, **kwargs)

        return run

    for name, method in saved.items():
        setattr(AcceleratorRuntime, name, slowed(method))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(AcceleratorRuntime, name, method)


def _each_case(
    cases: tuple[Any, ...], slow: Stream | None, name: Callable[[Any], str], check: Callable[[Any], str]
) -> dict[str, str]:
    """``check`` of each case in turn on this rank (device 0), one side stream ``slow``: its
    problem, '' for none, or the failure; stops at the first failure."""
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    results = {}
    with slowed(slow):
        for case in cases:
            try:
                results[name(case)] = check(case)
            except Exception as error:  # noqa: BLE001  (reported per case; the summary names it)
                results[name(case)] = traceback.format_exception_only(error)[-1].strip()
                break
    return results


def run_part(rank: int, world: int, arg: tuple[tuple[Case, ...], Stream | None]) -> dict[str, str]:
    """Each case in turn on this rank: '' when it matches the reference, else the failure."""

    def check(case: Case) -> str:
        check_outcomes(case, [run_case(rank, world, case)])
        return ""

    return _each_case(arg[0], arg[1], lambda c: str(c.name), check)


def run_fully_shard_part(
    rank: int, world: int, arg: tuple[tuple[FullyShardCase, ...], Stream | None]
) -> dict[str, str]:
    """Each ``fully_shard`` case in turn on this rank against PyTorch's ``fully_shard`` trained
    alike in the same world: '' when they agree, else the first problem or failure."""

    def check(case: FullyShardCase) -> str:
        problems = train_against_fsdp2(rank, world, case)
        return problems[0] if problems else ""

    return _each_case(arg[0], arg[1], lambda c: str(c.id), check)


def fully_shard_cases(world: int, device: str, quick: bool) -> tuple[FullyShardCase, ...]:
    """The ``fully_shard`` parity cases of a world of ``world`` ranks that run on ``device``:
    not offload (refused on an accelerator mesh) nor ``compile`` (no compiler is assumed)."""
    chosen = [c for c in FULLY_SHARD_CASES if c.world == world and not c.offload and not c.compiled]
    return tuple(dataclasses.replace(c, device=device) for c in (chosen[:2] if quick else chosen))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="two cases per part")
    args = parser.parse_args(argv)

    def on_device(cases: tuple[Case, ...]) -> tuple[Case, ...]:
        chosen = cases[:2] if args.quick else cases
        return tuple(dataclasses.replace(c, fsdp1=False, device=args.device) for c in chosen)

    lacking = run_world(2, probe, args.device, timeout=120)[0]
    print(f"gloo on {args.device} tensors lacks: {', '.join(lacking) or 'nothing this check uses'}", flush=True)
    parts: list[tuple[str, int, tuple[Any, ...], Stream | None]] = [
        ("sharded", 2, on_device(FLAT_CASES), None),
        ("hybrid", 4, on_device(HYBRID_CASES), None),
        ("sharded, slow post_backward stream", 2, on_device(FLAT_CASES), Stream.POST_BACKWARD),
        ("hybrid, slow all_reduce stream", 4, on_device(HYBRID_CASES), Stream.ALL_REDUCE),
        ("fully_shard against PyTorch's", 2, fully_shard_cases(2, args.device, args.quick), None),
        ("fully_shard against PyTorch's", 4, fully_shard_cases(4, args.device, args.quick), None),
        (
            "fully_shard, slow post_backward stream",
            4,
            fully_shard_cases(4, args.device, args.quick),
            Stream.POST_BACKWARD,
        ),
    ]
    failed = 0
    for name, world, cases, slow in parts:
        runner = run_fully_shard_part if cases and isinstance(cases[0], FullyShardCase) else run_part
        try:
            per_rank = run_world(world, runner, (cases, slow), timeout=240)
        except (RuntimeError, TimeoutError) as error:
            print(f"{name}, {world} ranks on {args.device}: did not finish: {str(error).splitlines()[0]}", flush=True)
            failed += 1
            continue
        bad = {case: why for results in per_rank for case, why in results.items() if why}
        ran = len(per_rank[0])
        good = sum(1 for case in per_rank[0] if case not in bad)
        print(f"{name}, {world} ranks on {args.device}: {good}/{len(cases)} cases match the reference", flush=True)
        for case, why in sorted(bad.items()):
            print(f"  {case}: {why}", flush=True)
        failed += len(bad) + len(cases) - ran
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
