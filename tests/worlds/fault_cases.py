"""Ranks that disagree, and steps that fail: what every rank sees (run on gloo worlds)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_core import MixedPrecision, ShardingStrategy
from fsdp_shell import FSDP, comm_hooks
from fsdp_shell.safety.agreement import RankMismatchError
from tests.worlds.divergence_cases import Block


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), Block(6), Block(6), nn.Linear(6, 1))


def _first_forward_error(build: object) -> str:
    """Build on this rank as ``build`` says, run one forward; the error every rank raises."""
    assert callable(build)
    try:
        model = build()
        model(torch.randn(2, 4))
    except RankMismatchError as exc:
        return str(exc)
    return ""


def mismatches(rank: int, world: int, _: None) -> dict[str, object]:
    """Each kind of disagreement, built differently on rank 0; the messages, and what the
    check cost in a world that agrees."""
    out: dict[str, object] = {}
    out["mixed_precision"] = _first_forward_error(
        lambda: FSDP(
            _model(),
            auto_wrap_policy={Block},
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if rank == 0 else None,
        )
    )
    out["wrap_policy"] = _first_forward_error(
        lambda: FSDP(_model(), auto_wrap_policy={Block} if rank == 0 else {Block, nn.Linear})
    )
    out["strategy"] = _first_forward_error(
        lambda: FSDP(
            _model(),
            auto_wrap_policy={Block},
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP if rank == 1 else ShardingStrategy.FULL_SHARD,
        )
    )

    def hooked() -> FSDP:
        model = FSDP(_model(), auto_wrap_policy={Block})
        if rank == 0:
            model.register_comm_hook(comm_hooks.DefaultState(model.process_group), comm_hooks.reduce_scatter_hook)
        return model

    out["comm_hook"] = _first_forward_error(hooked)
    agreeing = FSDP(_model(), auto_wrap_policy={Block})
    agreeing(torch.randn(2, 4)).sum().backward()
    out["agreement_seconds"] = agreeing._tree.agreement_seconds
    dist.barrier()
    return out


def mixed_layouts(rank: int, world: int, _: None) -> str:
    """Four ranks whose hybrid pairs are each fine alone but come from two different layouts."""
    rows = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    columns = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate"))
    mesh_groups = (rows.get_group(1), rows.get_group(0)) if rank < 2 else (columns.get_group(0), columns.get_group(1))
    return _first_forward_error(
        lambda: FSDP(
            _model(),
            auto_wrap_policy={Block},
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            process_group=mesh_groups,
        )
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)


class FailOnce:
    """A comm hook that raises the first time it is called, then reduce-scatters."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, state: object, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected failure in a comm hook")
        comm_hooks.reduce_scatter_hook(state, grad, output)  # type: ignore[arg-type]  # DefaultState passed through


def recovery(rank: int, world: int, use_orig_params: bool) -> float:
    """Step 0 fails in the user's loss, step 1 in a comm hook inside backward; steps 2-4 train.
    The largest difference from a reference that trained only the steps that succeeded."""
    model = _model()
    ref = copy.deepcopy(model)
    wrapped = FSDP(model, auto_wrap_policy={Block}, use_orig_params=use_orig_params)
    wrapped.register_comm_hook(comm_hooks.DefaultState(wrapped.process_group), FailOnce())
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        x, y = _batch(step, rank)
        try:
            out = wrapped(x)
            if step == 0:
                raise ValueError("injected failure in the loss")
            ((out - y) ** 2).mean().backward()
        except (ValueError, RuntimeError) as exc:
            assert "injected" in str(exc), exc
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
        xs = torch.cat([_batch(step, r)[0] for r in range(world)])
        ys = torch.cat([_batch(step, r)[1] for r in range(world)])
        ((ref(xs) - ys) ** 2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got, want = wrapped.state_dict(), ref.state_dict()
    return max(float((got[k] - v).abs().max()) for k, v in want.items())


def on_a_subgroup(rank: int, world: int, _: None) -> str:
    """FSDP on ranks 0-1 of a world of 4 while ranks 2-3 do nothing FSDP: its agreement check and
    end-of-backward check run on a group of those ranks only (created by them alone)."""
    first, second = dist.new_group([0, 1]), dist.new_group([2, 3])
    if rank >= 2:
        return "idle"
    model = FSDP(_model(), process_group=first, auto_wrap_policy={Block})
    for step in range(2):
        x, y = _batch(step, rank)
        ((model(x) - y) ** 2).mean().backward()
    assert second is not None
    return "trained"
