"""Live bytes per rank, ours against PyTorch's FSDP1 in the same world, by phase.

Run on demand: ``python benchmarks/bench_memory.py [--configs NAME,...] [--steps 3]``.

Each configuration trains the same model (an MLP of 6 residual 64-wide layers, or a tiny
Hugging Face GPT-2 or Llama) with AdamW for ``--steps`` steps, once with ours and once with
FSDP1, each under its own ``fsdp_shell.memory.LiveBytes`` (exact live tensor-storage bytes;
everything from the model's construction on is counted: ``fsdp_shell.memory.measure``).
Printed per configuration, worst rank: the peak of forward, backward and the optimizer step over
all steps, ours / FSDP1, and the bytes live after the last step. That each of our post-backward
hooks holds what ``fsdp_core.memory.backward_footprints`` predicts, to the byte, is the memory
tests' check (``tests/worlds/test_memory_gloo.py``), on these configurations too.

FSDP1 refuses ``CPUOffload(offload_params=True)`` without an accelerator (it pins memory), so
the offload configuration shows our bytes only. The figures do not depend on timing on our side
(``tests/worlds/test_memory_gloo.py``), so one run is enough; FSDP1's may vary by a few bytes between
runs (gloo's threads free its collectives' buffers when they are done with them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_shell.cli.launch import run_world
from fsdp_shell.memory.measure import PHASES, implementations, measure
from fsdp_shell.memory.workload import Config

CONFIGS: dict[str, Config] = {}
for _strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
    for _orig in (False, True):
        for _bf16 in (False, True):
            _name = f"mlp-{_strategy.lower()}{'-orig' if _orig else ''}{'-bf16' if _bf16 else ''}"
            CONFIGS[_name] = Config(_strategy, orig=_orig, bf16=_bf16)
CONFIGS["mlp-full_shard-no_sync"] = Config("FULL_SHARD", accumulate=2)
CONFIGS["mlp-full_shard-bf16-no_sync"] = Config("FULL_SHARD", bf16=True, accumulate=2)
CONFIGS["mlp-full_shard-offload"] = Config("FULL_SHARD", offload=True)
for _model in ("gpt2", "llama"):
    CONFIGS[f"{_model}-full_shard"] = Config("FULL_SHARD", model=_model)
    CONFIGS[f"{_model}-full_shard-bf16"] = Config("FULL_SHARD", model=_model, bf16=True)
    CONFIGS[f"{_model}-full_shard-orig-bf16"] = Config("FULL_SHARD", model=_model, orig=True, bf16=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--api",
        default="fsdp1",
        choices=["fsdp1", "fully_shard"],
        help="fsdp1: our FSDP1 API against PyTorch's FSDP1 (default); fully_shard: ours against FSDP2",
    )
    args = parser.parse_args()
    if args.api == "fully_shard":
        _fully_shard(args)
        return
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    print(f"{'configuration':<34} {'forward':>8} {'backward':>8} {'optim':>8} {'after':>8}")
    print(f"{'':<34} {'ours / FSDP1 (worst rank)':>35}")
    worst: dict[str, float] = {}
    for name in names:
        cfg = CONFIGS[name]
        ranks = run_world(cfg.world, measure, (cfg, args.steps, implementations(cfg)), timeout=600)
        if "fsdp1" not in implementations(cfg):
            ours = ", ".join(f"{k} {max(r['ours'][k] for r in ranks):,}" for k in PHASES)
            print(f"{name:<34} ours alone, bytes: {ours} (FSDP1 cannot offload without an accelerator)", flush=True)
            continue
        ratios = {k: max(r["ours"][k] / r["fsdp1"][k] for r in ranks) for k in PHASES}
        for k, v in ratios.items():
            worst[k] = max(worst.get(k, 0.0), v)
        print(
            f"{name:<34} {ratios['forward']:>8.3f} {ratios['backward']:>8.3f} {ratios['optimizer']:>8.3f} "
            f"{ratios['after']:>8.3f}",
            flush=True,
        )
    print("worst: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()))


def _fully_shard(args: argparse.Namespace) -> None:
    """Our ``fully_shard`` against PyTorch's, every configuration FSDP2 has a form of, each run
    twice (FSDP2's bytes on gloo move between runs; ours must not)."""
    names = [n for n in args.configs.split(",") if n and not any(x in n for x in ("no_shard", "orig", "offload"))]
    print(f"{'configuration':<34} {'forward':>8} {'backward':>8} {'optim':>8} {'after':>8}  ours run to run")
    print(f"{'':<34} {'ours / FSDP2 (worst rank)':>35}")
    worst: dict[str, float] = {}
    for name in names:
        cfg = CONFIGS[name]
        runs = [
            run_world(cfg.world, measure, (cfg, args.steps, ("ours_fully_shard", "fsdp2")), timeout=600)
            for _ in range(2)
        ]
        ratios = {k: max(r["ours_fully_shard"][k] / r["fsdp2"][k] for ranks in runs for r in ranks) for k in PHASES}
        same = all(a["ours_fully_shard"] == b["ours_fully_shard"] for a, b in zip(runs[0], runs[1]))
        theirs_same = all(a["fsdp2"] == b["fsdp2"] for a, b in zip(runs[0], runs[1]))
        for k, v in ratios.items():
            worst[k] = max(worst.get(k, 0.0), v)
        print(
            f"{name:<34} {ratios['forward']:>8.3f} {ratios['backward']:>8.3f} {ratios['optimizer']:>8.3f} "
            f"{ratios['after']:>8.3f}  {'same' if same else 'DIFFERS'} (FSDP2: {'same' if theirs_same else 'differs'})",
            flush=True,
        )
    print("worst: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
