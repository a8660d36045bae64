"""Predicted against measured: a whole model's live bytes per rank, by phase.

Run on demand: ``python benchmarks/bench_predict.py [--configs NAME,...] [--steps 3]``.

For each configuration, ``fsdp_shell.predict.predict_memory`` predicts every rank's bytes from
the model built on the meta device (no process group, no memory: the plans, the all-gather
schedule and a ``FakeTensorMode`` trace of one step); then a gloo world trains the model for
real, measured by ``fsdp_shell.memory.LiveBytes`` (``fsdp_shell.memory.measure``: exact live
tensor-storage bytes from the model's construction on, the peak of each phase over all steps);
``fsdp_shell.predict.against.compare`` gives the two side by side.
Printed per configuration, for the worst rank: predicted / measured peak of forward, backward
and the optimizer step, and the bytes left after the last step; then the largest error.

``--fsdp2`` prints PyTorch's FSDP2 trained alike under each ``fully_shard`` row, measured the
same way (PyTorch's own bytes beside ours).

``CONFIGS`` train with this library's FSDP1 API, ``FULLY_SHARD_CONFIGS`` (names starting
``fully_shard:``) with its ``fully_shard`` applied to every block and then the root
(``predict_memory(..., api="fully_shard")``; ``fsdp_shell.memory.workload.shard_per_block``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_shell.cli.launch import run_world
from fsdp_shell.memory.measure import PHASES, measure
from fsdp_shell.memory.workload import Config
from fsdp_shell.predict.against import compare

CONFIGS: dict[str, Config] = {
    "mlp-full_shard": Config("FULL_SHARD"),
    "mlp-full_shard-bf16": Config("FULL_SHARD", bf16=True),
    "mlp-full_shard-orig": Config("FULL_SHARD", orig=True),
    "mlp-full_shard-orig-bf16-no_sync": Config("FULL_SHARD", orig=True, bf16=True, accumulate=2),
    "mlp-shard_grad_op": Config("SHARD_GRAD_OP"),
    "mlp-shard_grad_op-bf16-no_sync": Config("SHARD_GRAD_OP", bf16=True, accumulate=3),
    "mlp-no_shard": Config("NO_SHARD"),
    "mlp-no_shard-bf16-no_sync": Config("NO_SHARD", bf16=True, accumulate=2),
    "mlp-hybrid_shard": Config("HYBRID_SHARD"),
    "mlp-hybrid_shard-bf16-orig": Config("HYBRID_SHARD", bf16=True, orig=True),
    "mlp-hybrid_shard-sync-no_sync": Config("HYBRID_SHARD", hybrid_all_reduce="sync", accumulate=2),
    "mlp-hybrid_shard_zero2-bf16": Config("HYBRID_SHARD_ZERO2", bf16=True),
    "mlp-full_shard-offload": Config("FULL_SHARD", offload=True),
    "mlp-full_shard-offload-bf16-orig": Config("FULL_SHARD", offload=True, bf16=True, orig=True),
    "mlp-full_shard-backward_post": Config("FULL_SHARD", backward_prefetch="BACKWARD_POST"),
    "mlp-full_shard-no_prefetch-forward_prefetch": Config(
        "FULL_SHARD", backward_prefetch="none", forward_prefetch=True
    ),
    "mlp-full_shard-sgd": Config("FULL_SHARD", optimizer="sgd"),
    "mlp-full_shard-orig-sgd_momentum": Config("FULL_SHARD", orig=True, optimizer="sgd_momentum"),
    "mlp-full_shard-adam": Config("FULL_SHARD", optimizer="adam"),
    "demo-full_shard": Config("FULL_SHARD", model="demo"),
    "demo-full_shard-bf16-orig": Config("FULL_SHARD", model="demo", bf16=True, orig=True),
    "demo-hybrid_shard-bf16-no_sync": Config("HYBRID_SHARD", model="demo", bf16=True, accumulate=2),
    "gpt2-full_shard": Config("FULL_SHARD", model="gpt2"),
    "gpt2-full_shard-bf16-orig": Config("FULL_SHARD", model="gpt2", bf16=True, orig=True),
    "gpt2-shard_grad_op-bf16-no_sync": Config("SHARD_GRAD_OP", model="gpt2", bf16=True, accumulate=2),
    "gpt2-hybrid_shard-bf16": Config("HYBRID_SHARD", model="gpt2", bf16=True),
    "llama-full_shard-bf16": Config("FULL_SHARD", model="llama", bf16=True),
    "llama-full_shard-orig-bf16-forward_prefetch": Config(
        "FULL_SHARD", model="llama", bf16=True, orig=True, forward_prefetch=True
    ),
    "llama-no_shard": Config("NO_SHARD", model="llama"),
    "llama-hybrid_shard_zero2-orig-sgd_momentum": Config(
        "HYBRID_SHARD_ZERO2", model="llama", orig=True, optimizer="sgd_momentum"
    ),
}


SYNC_EVERY_MICRO_CONFIGS: dict[str, Config] = {
    "mlp-full_shard-sync_every_micro": Config("FULL_SHARD", accumulate=2, sync_every_micro=True),
    "mlp-full_shard-orig-bf16-sync_every_micro3": Config(
        "FULL_SHARD", orig=True, bf16=True, accumulate=3, sync_every_micro=True
    ),
    "mlp-shard_grad_op-sync_every_micro": Config("SHARD_GRAD_OP", accumulate=2, sync_every_micro=True),
}
"""The FSDP1 API accumulating without ``no_sync()`` (``predict_memory(..., no_sync=False)``); apart
from ``CONFIGS``, which ``bench_step_time.py`` also runs."""

FULLY_SHARD_CONFIGS: dict[str, Config] = {
    f"fully_shard:{name}": cfg
    for name, cfg in {
        "mlp": Config("FULL_SHARD"),
        "mlp-bf16": Config("FULL_SHARD", bf16=True),
        "mlp-no_sync": Config("FULL_SHARD", accumulate=2),
        "mlp-bf16-no_sync": Config("FULL_SHARD", bf16=True, accumulate=2),
        "mlp-no_reshard": Config("SHARD_GRAD_OP"),
        "mlp-no_reshard-bf16-no_sync3": Config("SHARD_GRAD_OP", bf16=True, accumulate=3),
        "mlp-hsdp": Config("HYBRID_SHARD"),
        "mlp-hsdp-bf16-no_sync": Config("HYBRID_SHARD", bf16=True, accumulate=2),
        "mlp-hsdp-no_reshard-bf16": Config("HYBRID_SHARD_ZERO2", bf16=True),
        "mlp-hpz2": Config("FULL_SHARD", ranks=4, reshard_after_forward=2),
        "mlp-hpz2-bf16-no_sync": Config("FULL_SHARD", ranks=4, reshard_after_forward=2, bf16=True, accumulate=2),
        "mlp-offload": Config("FULL_SHARD", offload=True),
        "mlp-sgd": Config("FULL_SHARD", optimizer="sgd"),
        "mlp-sgd_momentum": Config("FULL_SHARD", optimizer="sgd_momentum"),
        "mlp-adam": Config("FULL_SHARD", optimizer="adam"),
        "mlp-3ranks": Config("FULL_SHARD", ranks=3),
        "mlp-1rank-bf16-no_sync": Config("FULL_SHARD", ranks=1, bf16=True, accumulate=2),
        "mlp-prefetch": Config("FULL_SHARD", explicit_prefetch=True),
        "mlp-prefetch-bf16-no_sync": Config("FULL_SHARD", explicit_prefetch=True, bf16=True, accumulate=2),
        "mlp-prefetch-hpz2-bf16": Config(
            "FULL_SHARD", ranks=4, explicit_prefetch=True, reshard_after_forward=2, bf16=True
        ),
        "mlp-hsdp-prefetch": Config("HYBRID_SHARD", explicit_prefetch=True),
        "mlp-sync_every_micro": Config("FULL_SHARD", accumulate=2, sync_every_micro=True),
        "mlp-hsdp-bf16-sync_every_micro3": Config("HYBRID_SHARD", bf16=True, accumulate=3, sync_every_micro=True),
        "demo": Config("FULL_SHARD", model="demo"),
        "demo-bf16": Config("FULL_SHARD", model="demo", bf16=True),
        "demo-hsdp-bf16-no_sync": Config("HYBRID_SHARD", model="demo", bf16=True, accumulate=2),
        "demo-prefetch-bf16": Config("FULL_SHARD", model="demo", bf16=True, explicit_prefetch=True),
        "gpt2": Config("FULL_SHARD", model="gpt2"),
        "gpt2-bf16": Config("FULL_SHARD", model="gpt2", bf16=True),
        "gpt2-no_reshard-bf16-no_sync": Config("SHARD_GRAD_OP", model="gpt2", bf16=True, accumulate=2),
        "gpt2-3ranks": Config("FULL_SHARD", model="gpt2", ranks=3),
        "llama-bf16": Config("FULL_SHARD", model="llama", bf16=True),
        "llama-hsdp-no_reshard-sgd_momentum": Config("HYBRID_SHARD_ZERO2", model="llama", optimizer="sgd_momentum"),
        "llama-3ranks": Config("FULL_SHARD", model="llama", ranks=3),
    }.items()
}
"""``fully_shard``'s: the strategy's name picks the mesh and whether blocks reshard after forward
(``no_reshard``: ``reshard_after_forward=False``), ``hpz2``: ``reshard_after_forward=2``."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    known = {**CONFIGS, **SYNC_EVERY_MICRO_CONFIGS, **FULLY_SHARD_CONFIGS}
    parser.add_argument("--configs", default=",".join(known), help="comma-separated names")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--fsdp2",
        action="store_true",
        help="after each fully_shard row, PyTorch's FSDP2 trained alike, measured the same way (its worst "
        "rank's bytes; none for offload, which FSDP2 pins)",
    )
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {', '.join(known)}")
    print(f"{'configuration':<50} " + " ".join(f"{p:>21}" for p in PHASES))
    print(f"{'':<50} " + " ".join(f"{'predicted / measured':>21}" for _ in PHASES))
    worst = 0.0
    for name in names:
        api = "fully_shard" if name in FULLY_SHARD_CONFIGS else "fsdp1"
        rows = compare(known[name], args.steps, api)
        rank = max(range(len(rows)), key=lambda r: rows[r][1]["backward"])
        predicted, measured = rows[rank]
        errors = [abs(p[k] / m[k] - 1) for p, m in rows for k in PHASES]
        worst = max(worst, *errors)
        cells = " ".join(f"{predicted[k]:>10,}/{measured[k]:<10,}" for k in PHASES)
        print(f"{name:<50} {cells}  max err {max(errors):.2%}", flush=True)
        cfg = known[name]
        if args.fsdp2 and api == "fully_shard" and not cfg.offload:
            theirs = [out["fsdp2"] for out in run_world(cfg.world, measure, (cfg, args.steps, ("fsdp2",)), timeout=600)]
            row = max(theirs, key=lambda m: m["backward"])
            cells = " ".join(f"{'':>10} {row[k]:<10,}" for k in PHASES)
            print(f"{'  FSDP2, measured':<50} {cells}", flush=True)
    print(f"largest error over every rank and phase: {worst:.3%}")


if __name__ == "__main__":
    main()
