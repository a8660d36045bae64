"""PyTorch's own ``fully_shard`` shards each parameter as ``PerParamLayout`` says.

FSDP2 is built under torch's fake process group (``torch.testing._internal.distributed.fake_pg``:
one process plays rank ``r`` of a world, and nothing is communicated), once per rank, and every
parameter's sharded size, padded size, padded shard and local values are compared with the
layout's. The default group is destroyed after each rank, so nothing leaks into other tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_core import PerParamLayout, UnitDtypes, unit_dtypes


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 5)
        self.b = nn.Linear(5, 3)


class _Wide(nn.Module):
    """A 4 x 6 weight sharded on dimension 1 (``shard_placement_fn``) beside a 7-row bias."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.b = nn.Parameter(torch.randn(7))


def _wide_placement(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.dim() == 2 else None


CASES: dict[str, tuple[Callable[[], nn.Module], int, Callable[[nn.Parameter], Shard | None] | None]] = {
    "linear-2": (lambda: nn.Linear(10, 9), 2, None),
    "two-linears-4": (_TwoLinears, 4, None),
    "shard-dim-1-3": (_Wide, 3, _wide_placement),
}


@pytest.fixture
def as_rank() -> Iterator[Callable[[int, int], None]]:
    """Make this process rank ``r`` of a fake world of ``n``; torn down after the test."""

    def join(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES)
def test_fully_shard_shards_as_the_layout_says(case: str, as_rank: Callable[[int, int], None]) -> None:
    make, world, placement = CASES[case]
    for rank in range(world):
        as_rank(rank, world)
        torch.manual_seed(0)
        model = make()
        full = {name: p.detach().clone() for name, p in model.named_parameters()}
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)), shard_placement_fn=placement)
        state = model._get_fsdp_state()  # type: ignore[operator]  # FSDPModule's private accessor, untyped
        params = state._fsdp_param_group.fsdp_params
        by_id = {id(q): n for n, q in model.named_parameters()}
        names = [by_id[id(p.sharded_param)] for p in params]  # FSDP2's order, not named_parameters()'
        layout = PerParamLayout.of(
            [(n, tuple(p._orig_size), p.fsdp_placement.dim) for n, p in zip(names, params)], torch.float32, world
        )
        for i, (name, p) in enumerate(zip(names, params)):
            where = f"{case} rank {rank} {name}"
            assert tuple(p.sharded_size) == layout.sharded_shape(i, rank), where
            assert tuple(p.padded_sharded_param_size) == layout.padded_sharded_shape(i), where
            assert p._sharded_param_data.numel() == layout.padded_shard_numel[i], where
            sharded = dict(model.named_parameters())[name]
            assert isinstance(sharded, DTensor), where
            local = sharded.to_local()
            mine = torch.chunk(full[name], world, dim=p.fsdp_placement.dim)
            want = mine[rank] if rank < len(mine) else full[name].new_empty(layout.sharded_shape(i, rank))
            assert torch.equal(local, want), where
        dist.destroy_process_group()


DTYPES = [None, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("orig", [torch.float32, torch.bfloat16])
def test_fully_shard_resolves_mixed_precision_as_unit_dtypes_does(
    orig: torch.dtype, as_rank: Callable[[int, int], None]
) -> None:
    """Every ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` pair of None, fp32, bf16 and
    fp16: FSDP2's own parameters gather in ``param_dtype or orig`` and reduce in ``reduce_dtype``
    or that (its ``None`` means "no cast")."""
    as_rank(0, 2)
    mesh = init_device_mesh("cpu", (2,))
    for param_dtype in DTYPES:
        for reduce_dtype in DTYPES:
            model = nn.Linear(4, 4).to(orig)
            policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            state = model._get_fsdp_state()  # type: ignore[operator]  # FSDPModule's private accessor
            state._lazy_init()  # where FSDP2 resolves the dtypes (its first forward)
            (p, _) = state._fsdp_param_group.fsdp_params
            compute = p.param_dtype or orig
            theirs = UnitDtypes(orig=p.orig_dtype, compute=compute, reduce=p.reduce_dtype or compute)
            assert unit_dtypes(orig, param_dtype, reduce_dtype) == theirs, (param_dtype, reduce_dtype)
