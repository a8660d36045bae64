"""``fsdp-demo``: train a small byte-level transformer LM with fsdp_shell's FSDP.

With no arguments: CPU, gloo, 2 local worker processes it spawns itself, 300 steps of training
on the standard library's Python sources. Under ``torchrun`` it takes ranks from the launcher
(``env://``) and uses NCCL with one GPU per rank when CUDA is present. Bad arguments, paths
included, exit 2 with one line on stderr before training; ``--check`` exits 1 when a step's
gradient, clipping or update leaves its rounding bound (``fsdp_shell.demo.check``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_core import (  # noqa: E402
    CommHook,
    CPUOffload,
    FlatParamLayout,
    MixedPrecision,
    PerParamLayout,
    PlanRequest,
    ShardingSpec,
    ShardingStrategy,
)
from fsdp_shell.cli.launch import run_world  # noqa: E402
from fsdp_shell.cli.parser import OneLineErrorParser, console_script  # noqa: E402
from fsdp_shell.demo import models  # noqa: E402
from fsdp_shell.demo.checkpoint import CheckpointError, read_meta  # noqa: E402
from fsdp_shell.demo.model import ModelConfig  # noqa: E402
from fsdp_shell.demo.train import DemoConfig, RunResult, run_rank  # noqa: E402
from fsdp_shell.runtime.device import current_accelerator  # noqa: E402

__all__ = ["main", "parse_config"]

MAX_NPROC = 64


DEMO_HOOKS = ("none", "allreduce", "reduce_scatter", "fp16_compress", "bf16_compress")
"""The comm hooks ``--comm-hook`` runs (a user hook needs code, so it is not offered)."""


class BadArgument(ValueError):
    """An argument combination that cannot run; the message names the argument."""


def _parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="fsdp-demo", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--api",
        default="fsdp1",
        choices=["fsdp1", "fully_shard"],
        help="fsdp1: FullyShardedDataParallel around the model (default); fully_shard: FSDP2's API, "
        "each block then the root (the strategy picks the mesh and whether blocks reshard after forward)",
    )
    p.add_argument(
        "--strategy", default="FULL_SHARD", help="NO_SHARD, FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, HYBRID_SHARD_ZERO2"
    )
    p.add_argument(
        "--nproc", type=int, default=2, help="local worker processes to spawn (default 2; ignored under torchrun)"
    )
    p.add_argument(
        "--shard-size",
        type=int,
        default=None,
        help="hybrid: ranks per shard group (default: a node's ranks, LOCAL_WORLD_SIZE under torchrun; all locally)",
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in all (default 300)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch (default 8)")
    p.add_argument("--mixed-precision", default="none", choices=["none", "bf16", "fp16"])
    p.add_argument("--offload", action="store_true", help="CPUOffload(offload_params=True)")
    p.add_argument("--use-orig-params", action="store_true")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step; all but the last in no_sync()")
    p.add_argument("--comm-hook", default="none", help=", ".join(DEMO_HOOKS))
    p.add_argument("--clip", type=float, default=None, help="clip the gradient norm to this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--model",
        default="tiny",
        choices=list(models.ARCHS),
        help="tiny (the demo's own), or a tiny Hugging Face gpt2 / llama (needs transformers)",
    )
    p.add_argument("--layers", type=int, default=3, help="transformer blocks (default 3)")
    p.add_argument("--width", type=int, default=64, help="model width (default 64)")
    p.add_argument("--eval-every", type=int, default=25, help="held-out evaluation interval in steps")
    p.add_argument(
        "--check",
        action="store_true",
        help="every step, compare gradients, clipping and update with an exact reference, within their rounding bound",
    )
    p.add_argument(
        "--plot", default=None, metavar="PATH", help="loss curves and step times, .png by default (needs matplotlib)"
    )
    p.add_argument("--save", default=None, metavar="DIR", help="write a sharded checkpoint at the end")
    p.add_argument("--resume", default=None, metavar="DIR", help="continue from a checkpoint")
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="torch.profiler traces of steps 3-5, DIR/trace_rankN.json (Perfetto)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def parse_config(argv: Sequence[str] | None) -> tuple[DemoConfig, int, Path | None]:
    """The run's configuration, its world size and the file ``--plot`` writes; raises
    ``BadArgument``."""
    a = _parser().parse_args(argv)
    try:
        strategy = ShardingStrategy.parse(a.strategy)
    except ValueError as exc:
        raise BadArgument(str(exc).replace("sharding_strategy", "--strategy")) from None
    if a.comm_hook not in DEMO_HOOKS:
        raise BadArgument(f"--comm-hook: expected one of {', '.join(DEMO_HOOKS)}, got {a.comm_hook!r}")
    hook = CommHook.parse(a.comm_hook)
    world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else a.nproc
    cpus = os.cpu_count() or 1
    if not _under_torchrun() and not 1 <= a.nproc <= min(MAX_NPROC, 4 * cpus):
        raise BadArgument(
            f"--nproc: expected 1..{min(MAX_NPROC, 4 * cpus)} local processes on this {cpus}-CPU machine, got {a.nproc}"
        )
    for name in ("steps", "batch_size", "grad_accum", "layers", "width", "eval_every"):
        if getattr(a, name) < 1:
            raise BadArgument(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(a, name)}")
    if a.width % 4:
        raise BadArgument(f"--width: must be a multiple of 4 (the number of heads), got {a.width}")
    if not (a.lr > 0 and math.isfinite(a.lr)):
        raise BadArgument(f"--lr: expected a positive learning rate, got {a.lr}")
    for flag, path in (("--save", a.save), ("--profile", a.profile)):
        if path is not None:
            _check_writable(flag, Path(path))
    if a.clip is not None and not a.clip > 0:
        raise BadArgument(f"--clip: expected a positive norm, got {a.clip}")
    if a.shard_size is not None and not strategy.is_hybrid:
        raise BadArgument(f"--shard-size: only hybrid strategies take a shard size, not {strategy.name}")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) if _under_torchrun() else 0
    shard = a.shard_size or (local if local > 0 and world % local == 0 else world)
    if strategy.is_hybrid and (shard < 1 or world % shard):
        raise BadArgument(
            f"--shard-size: {shard} does not divide the {world} processes; accepted: a divisor of {world}"
        )
    plot = None if a.plot is None else _plot_path(a.plot)
    if a.model != "tiny" and importlib.util.find_spec("transformers") is None:
        raise BadArgument(f"--model {a.model}: needs transformers; install it with pip install -e '.[hf]'")
    if a.check and a.resume is not None:
        raise BadArgument("--check: compares a whole run from step 0 with the reference; drop --resume")
    if a.api == "fully_shard":
        _check_fully_shard(a, strategy)
    cfg = DemoConfig(
        api=a.api,
        strategy=strategy,
        shard_size=shard if strategy.is_hybrid else None,
        steps=a.steps,
        batch_size=a.batch_size,
        mixed_precision=a.mixed_precision,
        offload=a.offload,
        use_orig_params=a.use_orig_params,
        grad_accum=a.grad_accum,
        comm_hook=hook,
        clip=a.clip,
        seed=a.seed,
        lr=a.lr,
        eval_every=a.eval_every,
        check=a.check,
        save=a.save,
        resume=a.resume,
        profile=a.profile,
        quiet=a.quiet,
        model=ModelConfig(layers=a.layers, width=a.width, arch=a.model),
    )
    _validate_plan_options(cfg, world)
    if cfg.resume is not None:
        _validate_resume(cfg)
    return cfg, world, plot


def _check_fully_shard(a: argparse.Namespace, strategy: ShardingStrategy) -> None:
    """What ``--api fully_shard`` has no use for, refused by flag."""
    if strategy is ShardingStrategy.NO_SHARD:
        raise BadArgument(
            "--strategy: fully_shard shards; for NO_SHARD's replication use --strategy HYBRID_SHARD --shard-size 1"
        )
    if a.use_orig_params:
        raise BadArgument("--use-orig-params: fully_shard's parameters are always the module's own; drop it")
    if a.comm_hook != "none":
        raise BadArgument("--comm-hook: FSDP1's communication hooks; fully_shard has none (set_all_reduce_hook)")


def _check_writable(flag: str, path: Path) -> None:
    """``path`` is, or can be made, a directory this process can write into: its nearest
    existing ancestor is a directory in which a file can be created (tried, then removed), so a
    read-only file system or a missing permission is refused now rather than after training."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise BadArgument(f"{flag}: {probe} is a file; expected a directory (or a path where one can be made)")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise BadArgument(f"{flag}: cannot write in {probe} ({exc.strerror or exc})") from None


def _plot_path(given: str) -> Path:
    """Where ``--plot`` writes: ``given``, with ``.png`` added when it names no format (as
    matplotlib would); its format must be one matplotlib writes and its folder writable."""
    if importlib.util.find_spec("matplotlib") is None:
        raise BadArgument("--plot: needs matplotlib; install it with pip install -e '.[plot]'")
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(given)
    if path.is_dir():
        raise BadArgument(f"--plot: {path} is a directory; expected a file name such as {path / 'loss.png'}")
    formats = FigureCanvasBase.get_supported_filetypes()
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    if path.suffix[1:].lower() not in formats:
        raise BadArgument(
            f"--plot: cannot write {path.suffix} files; accepted: {', '.join('.' + f for f in sorted(formats))}"
        )
    _check_writable("--plot", path.parent)
    return path


def _validate_plan_options(cfg: DemoConfig, world: int) -> None:
    """Let the core refuse impossible option combinations before any process starts."""
    mp = cfg.mixed() or MixedPrecision()
    sharding = ShardingSpec.for_world(cfg.strategy, world, cfg.shard_size)
    layout: FlatParamLayout | PerParamLayout = FlatParamLayout.of([("w", (1,))], torch.float32)
    if cfg.api == "fully_shard":
        layout = PerParamLayout.of([("w", (sharding.shard_size,))], torch.float32, sharding.shard_size)
    try:
        PlanRequest(
            layout=layout,
            sharding=sharding,
            mixed_precision=mp,
            offload=CPUOffload(offload_params=cfg.offload),
            comm_hook=cfg.comm_hook,
            use_orig_params=cfg.use_orig_params,
        )
    except (ValueError, TypeError) as exc:
        message = (
            str(exc).replace("comm_hook:", "--comm-hook:").replace("mixed_precision.reduce_dtype", "--mixed-precision")
        )
        raise BadArgument(message) from None


def _validate_resume(cfg: DemoConfig) -> None:
    assert cfg.resume is not None
    if not Path(cfg.resume).is_dir():
        raise BadArgument(f"--resume: {cfg.resume} is not a directory")
    meta = read_meta(Path(cfg.resume))
    here = dataclasses.asdict(cfg.model)
    saved = meta.get("model")
    if saved != here:
        theirs = saved if isinstance(saved, dict) else {}
        differ = ", ".join(
            f"{k} {here.get(k)} here, {theirs.get(k)} in the checkpoint"
            for k in sorted(set(here) | set(theirs))
            if here.get(k) != theirs.get(k)
        )
        raise BadArgument(f"--resume: {cfg.resume} holds a checkpoint of a different model: {differ or saved}")
    step = meta.get("step")
    if not isinstance(step, int) or step >= cfg.steps:
        raise BadArgument(f"--steps: the checkpoint is at step {step}; ask for more steps than that")


def _worker(rank: int, world: int, cfg: DemoConfig) -> RunResult:
    return run_rank(rank, world, cfg)


def _summary(cfg: DemoConfig, r: RunResult, plot: Path | None = None) -> str:
    steps = len(r.losses)
    times = r.step_seconds[1:] or r.step_seconds
    median = statistics.median(times) if times else 0.0
    first, last = (r.held_out[0][1], r.held_out[-1][1]) if r.held_out else (float("nan"), float("nan"))
    rows = [
        (
            "strategy",
            f"{cfg.strategy.name} on {r.world} rank(s)"
            + (f", shard groups of {cfg.shard_size}" if cfg.shard_size else "")
            + (" (fully_shard)" if cfg.api == "fully_shard" else ""),
        ),
        ("model", f"{r.params:,} parameters in {r.units} FSDP units"),
        ("steps", f"{r.start_step + 1}..{r.start_step + steps}" if steps else "none"),
        ("train loss", f"{r.losses[0]:.3f} -> {r.losses[-1]:.3f}" if steps else "-"),
        ("held-out loss", f"{first:.3f} -> {last:.3f}"),
        ("step time", f"{median * 1e3:.1f} ms (median)"),
        ("tokens/s", f"{r.tokens_per_step / median:,.0f}" if median else "-"),
        (
            "grad comm / step",
            f"{statistics.mean(r.comm_bytes) / 2**20:.3f} MiB per rank (from the plans that ran)" if steps else "-",
        ),
    ]
    if cfg.resume is not None:
        rows.append(("resumed from", f"{cfg.resume} at step {r.start_step}"))
    if cfg.save is not None:
        rows.append(("saved", f"{cfg.save} at step {cfg.steps} ({cfg.strategy.name}, {r.world} rank(s))"))
    if cfg.profile is not None:
        traces = Path(cfg.profile) / ("trace_rank0.json" if r.world == 1 else f"trace_rank{{0..{r.world - 1}}}.json")
        rows.append(("traces", f"{traces} (steps 3-5; open in https://ui.perfetto.dev)"))
    if plot is not None:
        rows.append(("plot", str(plot)))
    if r.check is not None:
        verdict, *details = r.check.lines()
        rows.append(("check", verdict))
        rows.extend(("", line) for line in details)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _plot(path: Path, r: RunResult) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = list(range(r.start_step + 1, r.start_step + len(r.losses) + 1))
    ax1.plot(xs, r.losses, label="train")
    ax1.plot([s for s, _ in r.held_out], [v for _, v in r.held_out], "o-", label="held-out")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (nats/byte)")
    ax1.legend()
    ax2.plot(xs, [t * 1e3 for t in r.step_seconds])
    ax2.set_xlabel("step")
    ax2.set_ylabel("step time (ms)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


@console_script("fsdp-demo")
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fsdp-demo``; returns the exit status."""
    try:
        cfg, world, plot = parse_config(argv)
    except BadArgument as exc:
        print(f"fsdp-demo: error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"fsdp-demo: error: --resume: {exc}", file=sys.stderr)
        return 1
    if _under_torchrun():
        accelerator = current_accelerator()
        backend = "gloo" if accelerator is None else dist.get_default_backend_for_device(accelerator)
        if accelerator is not None:
            torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, init_method="env://")
        try:
            result = run_rank(dist.get_rank(), dist.get_world_size(), cfg)
            gc.collect()
            dist.barrier()
        finally:
            dist.destroy_process_group()
        if result.rank != 0:
            return 0
    else:
        if not cfg.quiet:
            api = " with fully_shard" if cfg.api == "fully_shard" else ""
            print(
                f"fsdp-demo: {cfg.strategy.name}{api} on {world} local gloo process(es), {cfg.steps} steps", flush=True
            )
        result = run_world(world, _worker, cfg, timeout=3600)[0]
    if plot is not None:
        _plot(plot, result)
    print(_summary(cfg, result, plot), flush=True)
    return 1 if result.check is not None and not result.check.passed else 0


if __name__ == "__main__":
    sys.exit(main())
