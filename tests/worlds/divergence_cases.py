"""Ranks whose models take different paths: a skipped unit, an unused output (gloo worlds)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_core import ShardingStrategy
from fsdp_shell import FSDP
from fsdp_shell.safety.timeouts import CollectiveTimeoutError


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Branchy(nn.Module):
    """Four blocks; ``skip`` blocks are left out of the forward, ``unused`` ones run but their
    output does not reach the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.blocks = nn.ModuleList(Block(6) for _ in range(4))
        self.head = nn.Linear(6, 1)

    def forward(
        self, x: torch.Tensor, skip: frozenset[int] = frozenset(), unused: frozenset[int] = frozenset()
    ) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i in skip:
                continue
            out = block(h)
            if i not in unused:
                h = out
        result: torch.Tensor = self.head(h)
        return result


@dataclass(frozen=True)
class Divergence:
    name: str
    skip: tuple[frozenset[int], ...]
    """Per rank (cycled): the blocks its forward skips."""
    unused: tuple[frozenset[int], ...] = (frozenset(),)
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    use_orig_params: bool = False


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)


def _path(case: Divergence, rank: int, step: int) -> tuple[frozenset[int], frozenset[int]]:
    """Each step a different rank diverges, so every unit sees both cases."""
    k = rank + step
    return case.skip[k % len(case.skip)], case.unused[k % len(case.unused)]


def run_divergence(rank: int, world: int, case: Divergence) -> tuple[float, int]:
    """Largest difference from the reference after 3 steps, and the agreements run."""
    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    mesh = (
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        if case.strategy.is_hybrid
        else None
    )
    wrapped = FSDP(
        model,
        auto_wrap_policy={Block},
        sharding_strategy=case.strategy,
        use_orig_params=case.use_orig_params,
        device_mesh=mesh,
        ranks_may_diverge=True,
    )
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = _batch(step, rank)
        skip, unused = _path(case, rank, step)
        torch.autograd.backward(((wrapped(x, skip=skip, unused=unused) - y) ** 2).mean())
        opt.step()
        opt.zero_grad()
        total = torch.zeros(())
        for r in range(world):
            xr, yr = _batch(step, r)
            skip_r, unused_r = _path(case, r, step)
            total = total + ((ref(xr, skip=skip_r, unused=unused_r) - yr) ** 2).mean() / world
        torch.autograd.backward(total)
        ref_opt.step()
        ref_opt.zero_grad()
    got, want = wrapped.state_dict(), ref.state_dict()
    sequencer = wrapped._tree.sequencer
    return max(float((got[k] - v).abs().max()) for k, v in want.items()), 0 if sequencer is None else sequencer.calls


def run_divergences(rank: int, world: int, cases: tuple[Divergence, ...]) -> dict[str, tuple[float, int]]:
    return {c.name: run_divergence(rank, world, c) for c in cases}


def undetected_by_default(rank: int, world: int, _: None) -> str:
    """Without ``ranks_may_diverge``: rank 0 leaves block 1's output unused, rank 1 block 2's.
    Both reduce as many equal-sized units, so the collectives pair wrongly but complete; the
    end-of-backward check must make every rank raise before the optimizer could step."""
    torch.manual_seed(0)
    wrapped = FSDP(Branchy(), auto_wrap_policy={Block})
    x, y = _batch(0, rank)
    try:
        torch.autograd.backward(((wrapped(x, unused=frozenset({1 + rank})) - y) ** 2).mean())
    except RuntimeError as exc:
        return str(exc)
    return ""


def gives_up_by_default(rank: int, world: int, skip_on_rank_1: frozenset[int]) -> str:
    """Without ``ranks_may_diverge``: rank 1's forward skips ``skip_on_rank_1``, so some rank waits
    in a collective the others never issue. Every rank must raise ``CollectiveTimeoutError`` when
    the process group's timeout (4 s here) expires, saying what to do."""
    group = dist.new_group(timeout=timedelta(seconds=4))
    torch.manual_seed(0)
    wrapped = FSDP(Branchy(), auto_wrap_policy={Block}, process_group=group)
    x, y = _batch(0, rank)
    try:
        torch.autograd.backward(((wrapped(x, skip=skip_on_rank_1 if rank == 1 else frozenset()) - y) ** 2).mean())
    except CollectiveTimeoutError as exc:
        return str(exc)
    return ""
