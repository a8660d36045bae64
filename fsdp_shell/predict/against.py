"""The prediction of a whole training configuration, and the prediction beside the measurement.

``predict`` is ``predict_memory`` for a ``Config`` (``fsdp_shell.memory.workload``) on the CPU
runtime, from its model built on the meta device: no process group, no memory. ``compare``
then trains the configuration on a real gloo world of its size, measured by ``LiveBytes``
(``fsdp_shell.memory.measure``), and gives every rank's predicted and measured bytes of each
of ``PHASES`` side by side; the memory tests require them equal, to the byte.
"""

from __future__ import annotations

import torch

from fsdp_core import CPUOffload, MixedPrecision
from fsdp_core.memory import Phase
from fsdp_shell.cli.launch import run_world
from fsdp_shell.memory.measure import PHASES, measure
from fsdp_shell.memory.workload import Config, Impl, loss_of, model_of
from fsdp_shell.predict.model import Prediction, predict_memory

__all__ = ["compare", "predict", "predicted_phases"]


def predict(cfg: Config, api: str = "fsdp1") -> Prediction:
    """``cfg``'s prediction for the CPU runtime with ``api`` (``predict_memory``'s), from the
    model built on the meta device; with ``fully_shard`` the blocks, then the root, as
    ``fsdp_shell.memory.workload.shard_per_block`` shards them."""
    fully_shard = api == "fully_shard"
    with torch.device("meta"):
        module, block = model_of(cfg)
    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.bf16 else None
    return predict_memory(
        module,
        lambda m: loss_of(m, cfg, 0, 0),
        world_size=cfg.world,
        shard_size=cfg.shard_size,
        sharding_strategy=cfg.strategy,
        mixed_precision=precision,
        cpu_offload=CPUOffload(offload_params=cfg.offload),
        auto_wrap_policy={block},
        use_orig_params=cfg.orig,
        backward_prefetch=None if fully_shard else cfg.backward_prefetch,
        forward_prefetch=cfg.forward_prefetch,
        hybrid_all_reduce=cfg.hybrid_all_reduce,
        optimizer=cfg.optimizer,
        accumulate=cfg.accumulate,
        no_sync=not cfg.sync_every_micro,
        backend="gloo",
        api=api,
        reshard_after_forward=cfg.reshard_after_forward,
        explicit_prefetch=cfg.explicit_prefetch,
    )


def predicted_phases(prediction: Prediction, rank: int) -> dict[str, int]:
    """The predicted bytes of each of ``PHASES`` for global ``rank`` (its rank in the shard group)."""
    memory = prediction.ranks[rank % len(prediction.ranks)]
    out = {phase.value: memory.phase_peak(phase).bytes for phase in Phase}
    out["after"] = sum(memory.after_step.values())
    return out


def compare(cfg: Config, steps: int, api: str = "fsdp1") -> list[tuple[dict[str, int], dict[str, int]]]:
    """Per rank, (predicted, measured) bytes of each of ``PHASES``: ``cfg`` predicted for ``api``,
    then trained for ``steps`` steps with ours (the FSDP1 API or ``fully_shard``) on a gloo world
    of ``cfg.world`` ranks."""
    prediction = predict(cfg, api)
    impl: Impl = "ours_fully_shard" if api == "fully_shard" else "ours"
    ranks = run_world(cfg.world, measure, (cfg, steps, (impl,)), timeout=600)
    return [(predicted_phases(prediction, rank), {k: out[impl][k] for k in PHASES}) for rank, out in enumerate(ranks)]
