"""Drop-in use: the FSDP1 training loop, with one import changed.

Run: python examples/drop_in.py  (spawns 2 gloo ranks on CPU)
 or: torchrun --nproc-per-node 2 examples/drop_in.py  (the launcher's ranks, gloo)
"""

import os

import torch
import torch.distributed as dist
from torch import nn

# FSDP1: from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from fsdp_shell import FSDP, MixedPrecision, ShardingStrategy
from fsdp_shell.cli.launch import run_world


def train(rank: int, world: int, _: None) -> None:
    """One rank, in an initialised process group (``run_world``'s, or torchrun's)."""
    assert dist.is_initialized()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    model = FSDP(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy={nn.Linear},
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(rank)
    for step in range(20):
        x = torch.randn(16, 32, generator=data)
        loss = (model(x).float() - x.sum(dim=1, keepdim=True)).square().mean()
        loss.backward()
        model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
        if rank == 0 and step % 5 == 4:
            print(f"step {step + 1}: loss {loss.item():.3f}")
    state = model.full_state_dict()  # full tensors under the original names, on every rank
    if rank == 0:
        print(f"trained {sum(v.numel() for v in state.values())} parameters: {', '.join(state)}", flush=True)


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), None)
        finally:
            dist.destroy_process_group()
    else:
        run_world(2, train, None)
