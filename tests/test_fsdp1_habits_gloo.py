"""FSDP1 habits of training scripts, on a gloo world of 2 (issue 17's list, as it lands).

- ``clip_grad_norm_(float("inf"))``, the usual way to log the gradient norm: returns the total
  norm (the reference's) and changes no gradient;
- attribute fall-through: what the wrapper lacks is the wrapped module's (``model.config``, a
  submodule, a plain attribute), on the root and on nested units; a wrapped ``nn.Sequential``
  is subscriptable; the wrapper's own attributes still win.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fsdp_shell import FSDP
from tests.dist_harness import run_world


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)
        self.kind = "block"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.tanh(self.up(x)))
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = {"hidden": 4}
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(x))
        return out


def habits(rank: int, world: int, _: None) -> dict[str, object]:
    out: dict[str, object] = {}
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    model = FSDP(net, auto_wrap_policy={Block})
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    mine = x[3 * rank : 3 * (rank + 1)]
    model(mine).square().mean().backward()
    ref(x).square().mean().backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    norm = model.clip_grad_norm_(float("inf"))
    after = [p.grad for p in model.parameters() if p.grad is not None]
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    out["norm_diff"] = float((norm - want).abs())
    out["grads_unchanged"] = len(before) > 0 and all(torch.equal(b, a) for b, a in zip(before, after))

    out["config"] = model.config
    out["blocks_is_inner"] = model.blocks is net.blocks
    first = model.blocks[0]
    out["nested_unit"] = isinstance(first, FSDP)
    out["nested_attr"] = first.kind
    out["nested_submodule"] = isinstance(first.up, nn.Linear)
    out["own_attr_wins"] = model.sharding_strategy.name
    try:
        model.no_such_thing  # noqa: B018
        out["missing"] = "found"
    except AttributeError as error:
        out["missing"] = str(error)

    seq = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    out["indexed"] = [type(seq[i]).__name__ for i in range(3)]
    return out


def test_fsdp1_habits() -> None:
    for out in run_world(2, habits, None, timeout=120):
        norm_diff = out["norm_diff"]
        assert isinstance(norm_diff, float) and norm_diff < 1e-6
        assert out["grads_unchanged"] is True
        assert out["config"] == {"hidden": 4}
        assert out["blocks_is_inner"] is True
        assert out["nested_unit"] is True and out["nested_attr"] == "block" and out["nested_submodule"] is True
        assert out["own_attr_wins"] == "FULL_SHARD"
        assert "no_such_thing" in str(out["missing"])
        assert out["indexed"] == ["Linear", "Tanh", "Linear"]
