"""What one ``fsdp-demo`` run depends on (built and validated by the command line)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_core import CommHook, MixedPrecision, ShardingStrategy
from fsdp_shell.demo.model import ModelConfig

__all__ = ["DemoConfig"]


@dataclass(frozen=True)
class DemoConfig:
    """Everything a run depends on (built and validated by the command line)."""

    api: str = "fsdp1"
    """``fsdp1``: ``FullyShardedDataParallel`` around the model; ``fully_shard``: FSDP2's API, each
    block then the root (``fsdp_shell.fully_shard``)."""
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    shard_size: int | None = None
    steps: int = 300
    batch_size: int = 8
    mixed_precision: str = "none"
    offload: bool = False
    use_orig_params: bool = False
    grad_accum: int = 1
    comm_hook: CommHook = CommHook.NONE
    clip: float | None = None
    seed: int = 0
    lr: float = 3e-3
    eval_every: int = 25
    check: bool = False
    save: str | None = None
    resume: str | None = None
    profile: str | None = None
    quiet: bool = False
    model: ModelConfig = ModelConfig()

    def mixed(self) -> MixedPrecision | None:
        """The ``MixedPrecision`` for ``--mixed-precision``: compute in bf16/fp16, reduce in fp32."""
        if self.mixed_precision == "bf16":
            return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.mixed_precision == "fp16":
            return MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
        return None
