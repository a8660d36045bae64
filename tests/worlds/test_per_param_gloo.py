"""On real gloo ranks, a per-parameter unit gathered through ``PerParamLayout`` is what PyTorch's
``fully_shard`` gathers: each rank copies FSDP2's own padded shards in, one
``all_gather_into_tensor`` runs in place, and the copy-out equals both FSDP2's unsharded
parameters after ``unshard()`` and the model before sharding, exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from fsdp_core import PerParamLayout
from fsdp_shell.runtime.collectives import all_gather_flat
from fsdp_shell.units.per_param import copy_in, copy_out
from tests.worlds.dist_harness import run_world


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 9)  # 9 rows: uneven on 2 and 4 ranks
        self.down = nn.Linear(9, 6, bias=False)
        self.scale = nn.Parameter(torch.randn(1))  # one row: the other ranks hold none
        self.wide = nn.Parameter(torch.randn(3, 8))  # Shard(1) where 8 divides


def _placement(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.shape == (3, 8) else None


def gathered_like_fsdp2(rank: int, world: int, arg: None) -> list[str]:
    """Problems found on this rank (none when ours and FSDP2's gathers agree)."""
    torch.manual_seed(0)
    model = _Block()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), shard_placement_fn=_placement)
    params = model._get_fsdp_state()._fsdp_param_group.fsdp_params  # type: ignore[operator]  # FSDPModule's private accessor
    by_id = {id(q): n for n, q in model.named_parameters()}
    names = [by_id[id(p.sharded_param)] for p in params]  # FSDP2's order, not named_parameters()'
    layout = PerParamLayout.of(
        [(n, tuple(p._orig_size), p.fsdp_placement.dim) for n, p in zip(names, params)], torch.float32, world
    )
    gathered = torch.empty(layout.total_numel)
    shards = [p._sharded_param_data.view(layout.padded_sharded_shape(i)) for i, p in enumerate(params)]
    mine = copy_in(layout, shards, gathered, rank)
    world_group = dist.group.WORLD
    assert isinstance(world_group, dist.ProcessGroup)
    all_gather_flat(gathered, mine, world_group)
    ours = dict(zip(names, copy_out(layout, gathered)))
    model.unshard()  # type: ignore[operator]  # FSDPModule's, untyped
    theirs = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.reshard()  # type: ignore[operator]  # FSDPModule's, untyped
    problems = [f"{n}: ours differs from FSDP2's unshard()" for n in names if not torch.equal(ours[n], theirs[n])]
    problems += [
        f"{n}: ours differs from the model before sharding" for n in names if not torch.equal(ours[n], before[n])
    ]
    return problems


@pytest.mark.parametrize("world", [2, 4])
def test_the_copy_out_of_one_all_gather_is_fsdp2s_unsharded_model(world: int) -> None:
    assert run_world(world, gathered_like_fsdp2, None, timeout=120) == [[]] * world
