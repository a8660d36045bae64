"""On real gloo ranks, a per-parameter unit moved through ``PerParamLayout`` is what PyTorch's
``fully_shard`` moves, exactly:

- gathered: each rank copies FSDP2's own padded shards in, one ``all_gather_into_tensor`` runs
  in place, and the copy-out equals both FSDP2's unsharded parameters after ``unshard()`` and the
  model before sharding;
- reduced: each rank's unsharded gradients (of an unsharded copy, on the rank's own batch)
  copied in, one averaging ``reduce_scatter_tensor`` as FSDP2 issues it, and the sharded
  gradients equal FSDP2's ``.grad`` after its backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from fsdp_core import PerParamLayout
from fsdp_shell.runtime.collectives import all_gather_flat
from fsdp_shell.units.per_param import copy_in, copy_in_grads, copy_out, sharded_grads
from tests.worlds.dist_harness import run_world


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 9)  # 9 rows: uneven on 2 and 4 ranks
        self.down = nn.Linear(9, 6, bias=False)
        self.scale = nn.Parameter(torch.randn(1))  # one row: the other ranks hold none
        self.wide = nn.Parameter(torch.randn(3, 8))  # Shard(1) where 8 divides

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.down(torch.relu(self.up(x))) * self.scale
        return (y[:, :3] @ self.wide).square().sum() + y.sum()


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
    gathered = torch.empty(layout.padded_numel)
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


def reduced_like_fsdp2(rank: int, world: int, arg: None) -> list[str]:
    """Problems found on this rank (none when ours and FSDP2's sharded gradients agree)."""
    torch.manual_seed(0)
    plain = _Block()
    sharded = _Block()
    sharded.load_state_dict(plain.state_dict())
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)), shard_placement_fn=_placement)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    plain(x).backward()
    sharded(x).backward()
    params = sharded._get_fsdp_state()._fsdp_param_group.fsdp_params  # type: ignore[operator]  # FSDPModule's private accessor
    by_id = {id(q): n for n, q in sharded.named_parameters()}
    names = [by_id[id(p.sharded_param)] for p in params]
    layout = PerParamLayout.of(
        [(n, tuple(p._orig_size), p.fsdp_placement.dim) for n, p in zip(names, params)], torch.float32, world
    )
    grads = dict(plain.named_parameters())
    full = torch.empty(layout.padded_numel)
    copy_in_grads(layout, [grads[n].grad for n in names], full)  # type: ignore[misc]  # every parameter has a gradient
    reduced = torch.empty(layout.slice_numel)
    world_group = dist.group.WORLD
    assert isinstance(world_group, dist.ProcessGroup)
    dist.reduce_scatter_tensor(reduced, full, op=dist.ReduceOp.AVG, group=world_group)  # FSDP2's call, fp32 on gloo
    theirs = dict(sharded.named_parameters())
    problems = []
    for name, ours in zip(names, sharded_grads(layout, reduced, rank)):
        grad = theirs[name].grad
        assert isinstance(grad, DTensor), name
        if not torch.equal(ours, grad.to_local()):
            problems.append(
                f"{name}: ours {ours.flatten()[:4].tolist()} FSDP2 {grad.to_local().flatten()[:4].tolist()}"
            )
    return problems


@pytest.mark.parametrize("world", [2, 4])
def test_the_sharded_gradients_of_one_reduce_scatter_are_fsdp2s(world: int) -> None:
    assert run_world(world, reduced_like_fsdp2, None, timeout=120) == [[]] * world
