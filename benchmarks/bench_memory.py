"""Live bytes per rank, ours against PyTorch's FSDP1 in the same world, by phase; and every
post-backward hook against the memory prediction.

Run on demand: ``python benchmarks/bench_memory.py [--configs NAME,...] [--steps 3]``.

Each configuration trains the same model (an MLP of 6 residual 64-wide layers, or a tiny
Hugging Face GPT-2 or Llama) with AdamW for ``--steps`` steps, once with ours and once with
FSDP1, each under its own ``fsdp_shell.memory.LiveBytes`` (exact live tensor-storage bytes;
everything from the model's construction on is counted). Printed per configuration, worst rank:
the peak of forward, backward and the optimizer step over all steps, ours / FSDP1, and the bytes
live after the last step; then how many of our post-backward hooks held exactly what
``fsdp_core.memory.backward_footprints`` predicts (peak and net bytes of each hook, to the byte).

FSDP1 refuses ``CPUOffload(offload_params=True)`` without an accelerator (it pins memory), so
the offload configuration shows our hooks only. The figures do not depend on timing on our side
(``tests/worlds/test_memory_gloo.py``), so one run is enough; FSDP1's may vary by a few bytes between
runs (gloo's threads free its collectives' buffers when they are done with them).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_core import ShardingStrategy
from fsdp_shell import FSDP
from fsdp_shell.cli.launch import run_world
from fsdp_shell.demo.model import Block, ModelConfig, TinyLM, lm_loss
from fsdp_shell.memory import LiveBytes
from fsdp_shell.runtime.cpu import CpuRuntime
from tests.worlds.memory_cases import measuring_plans


@dataclass(frozen=True)
class Config:
    strategy: str
    model: str = "mlp"
    """``mlp`` (6 residual 64-wide layers), ``demo`` (fsdp-demo's ``TinyLM``), or a tiny Hugging
    Face ``gpt2`` or ``llama``."""
    orig: bool = False
    bf16: bool = False
    accumulate: int = 1
    offload: bool = False
    backward_prefetch: str = "BACKWARD_PRE"
    forward_prefetch: bool = False
    optimizer: str = "adamw"
    """``adamw``, ``adam``, ``sgd`` or ``sgd_momentum`` (torch's defaults, lr aside)."""
    hybrid_all_reduce: str = "async"
    ranks: int | None = None
    """The world's size; None: 4 for hybrid strategies (2 x 2), else 2."""

    @property
    def world(self) -> int:
        if self.ranks is not None:
            return self.ranks
        return 4 if self.strategy.startswith("HYBRID") else 2

    @property
    def shard_size(self) -> int | None:
        return min(2, self.world) if self.strategy.startswith("HYBRID") else None


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


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.lin(x)) + x
        return out


DEMO = ModelConfig(vocab=256, seq=32, width=64, heads=4, layers=3)


def net(cfg: Config) -> tuple[nn.Module, type[nn.Module]]:
    """The configuration's model (seeded, on the default device: ``torch.device("meta")`` for
    one with no memory) and its block class."""
    torch.manual_seed(0)
    if cfg.model == "mlp":
        return nn.Sequential(*(Layer() for _ in range(6))), Layer
    if cfg.model == "demo":
        return TinyLM(DEMO), Block
    from tests.worlds.hf_cases import make_model

    return make_model(cfg.model)


def loss_of(model: nn.Module, cfg: Config, rank: int, step: int) -> torch.Tensor:
    """One forward of a training step: the batch of ``rank`` at ``step``, and the loss. Under
    ``FakeTensorMode`` the batch is fake (the generator is ignored there)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    if cfg.model == "mlp":
        out: torch.Tensor = model(torch.randn(8, 64, generator=gen)).float().square().mean()
        return out
    if cfg.model == "demo":
        tokens = torch.randint(0, DEMO.vocab, (4, DEMO.seq + 1), generator=gen)
        return lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    ids = torch.randint(0, 64, (2, 16), generator=gen)
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    return loss


def optimizer_of(cfg: Config, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The configuration's optimizer, with torch's defaults but the learning rate."""
    match cfg.optimizer:
        case "adamw":
            return torch.optim.AdamW(params, lr=1e-3)
        case "adam":
            return torch.optim.Adam(params, lr=1e-3)
        case "sgd":
            return torch.optim.SGD(params, lr=1e-3)
        case "sgd_momentum":
            return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    raise ValueError(f"optimizer: unknown {cfg.optimizer!r}")


def _wrap(impl: str, cfg: Config) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffload, MixedPrecision
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    module, block = net(cfg)
    mesh = None
    if cfg.shard_size is not None:
        mesh = init_device_mesh(
            "cpu", (cfg.world // cfg.shard_size, cfg.shard_size), mesh_dim_names=("replicate", "shard")
        )
    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16 else None
    offload = CPUOffload(offload_params=cfg.offload)
    prefetch = None if cfg.backward_prefetch == "none" else cfg.backward_prefetch
    if impl == "ours":
        return FSDP(
            module,
            auto_wrap_policy={block},
            sharding_strategy=ShardingStrategy[cfg.strategy],
            mixed_precision=precision,
            use_orig_params=cfg.orig,
            device_mesh=mesh,
            cpu_offload=offload,
            backward_prefetch=prefetch,
            forward_prefetch=cfg.forward_prefetch,
            hybrid_all_reduce=cfg.hybrid_all_reduce,
        )
    from torch.distributed.fsdp import BackwardPrefetch

    strategy = TorchStrategy[cfg.strategy.replace("HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2")]
    return TorchFSDP(
        module,
        auto_wrap_policy=ModuleWrapPolicy({block}),
        sharding_strategy=strategy,
        mixed_precision=precision,
        use_orig_params=cfg.orig,
        device_mesh=mesh,
        cpu_offload=offload,
        device_id=torch.device("cpu"),
        backward_prefetch=None if prefetch is None else BackwardPrefetch[prefetch],
        forward_prefetch=cfg.forward_prefetch,
    )


def measure(rank: int, world: int, job: tuple[Config, int]) -> dict[str, dict[str, int]]:
    """Both implementations' peaks by phase (and, for ours, the hooks matching the prediction)."""
    cfg, steps = job
    return measure_impls(rank, world, (cfg, steps, ("ours", "fsdp1") if not cfg.offload else ("ours",)))


def measure_impls(rank: int, world: int, job: tuple[Config, int, tuple[str, ...]]) -> dict[str, dict[str, int]]:
    """``measure`` for the implementations named (``ours``, ``fsdp1``)."""
    cfg, steps, impls = job
    out: dict[str, dict[str, int]] = {}
    for impl in impls:
        gc.collect()
        hooks: list[tuple[str, int, int, int, int]] = []
        with LiveBytes() as live:
            model = _wrap(impl, cfg)
            opt = optimizer_of(cfg, model.parameters())
            runtime = getattr(getattr(model, "_tree", None), "runtime", None)
            with measuring_plans(live, runtime, hooks) if isinstance(runtime, CpuRuntime) else contextlib.nullcontext():
                for step in range(steps):
                    for micro in range(cfg.accumulate):
                        sync = micro == cfg.accumulate - 1
                        with contextlib.nullcontext() if sync else model.no_sync():  # type: ignore[operator]  # both wrappers have no_sync
                            with live.phase("forward"):
                                loss = loss_of(model, cfg, rank, step)
                            with live.phase(f"backward {step}.{micro}"):
                                torch.autograd.backward(loss)
                            del loss
                    with live.phase("optimizer"):
                        opt.step()
                        opt.zero_grad()
            backward = max(v for k, v in live.peaks.items() if k.startswith("backward"))
            out[impl] = {
                "forward": live.peaks["forward"],
                "backward": backward,
                "optimizer": live.peaks["optimizer"],
                "after": live.current,
                "hooks": len(hooks),
                "hooks_exact": sum((peak, net) == (want_peak, want_net) for _, peak, want_peak, net, want_net in hooks),
            }
            del model, opt
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    print(f"{'configuration':<34} {'forward':>8} {'backward':>8} {'optim':>8} {'after':>8}  hooks exact")
    print(f"{'':<34} {'ours / FSDP1 (worst rank)':>35}")
    worst: dict[str, float] = {}
    for name in names:
        cfg = CONFIGS[name]
        ranks = run_world(cfg.world, measure, (cfg, args.steps), timeout=600)
        hooks = sum(r["ours"]["hooks"] for r in ranks)
        exact = sum(r["ours"]["hooks_exact"] for r in ranks)
        if cfg.offload:
            print(f"{name:<34} {'(FSDP1 cannot offload without an accelerator)':>35}  {exact}/{hooks}", flush=True)
            continue
        ratios = {
            k: max(r["ours"][k] / r["fsdp1"][k] for r in ranks) for k in ("forward", "backward", "optimizer", "after")
        }
        for k, v in ratios.items():
            worst[k] = max(worst.get(k, 0.0), v)
        print(
            f"{name:<34} {ratios['forward']:>8.3f} {ratios['backward']:>8.3f} {ratios['optimizer']:>8.3f} "
            f"{ratios['after']:>8.3f}  {exact}/{hooks}",
            flush=True,
        )
    print("worst: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
