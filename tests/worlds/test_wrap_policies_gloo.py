"""torch's auto-wrap policies choose the same units here as in PyTorch's FSDP1, on gloo worlds of 2 and 4.

``transformer_auto_wrap_policy``, ``size_based_auto_wrap_policy`` and
``lambda_auto_wrap_policy`` (as ``functools.partial``, the accelerate/llama-recipes setup),
``ModuleWrapPolicy``, ``CustomPolicy`` and a plain ``callable(module) -> bool``: each wraps the
same model in both libraries; the units (by their modules' names in the unwrapped model) must
be the same, and one training step must leave the same full state dict.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from fsdp_shell import FSDP
from tests.worlds.dist_harness import run_world


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.tanh(self.up(x)))
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 6)
        self.blocks = nn.Sequential(Block(6), Block(6), nn.Sequential(Block(6), nn.LayerNorm(6)))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.embed(x)))
        return out


POLICIES: dict[str, Callable[[], object]] = {
    "transformer": lambda: functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    "size-based": lambda: functools.partial(size_based_auto_wrap_policy, min_num_params=100),
    "lambda": lambda: functools.partial(
        lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear) and m.out_features > 6
    ),
    "module-wrap": lambda: ModuleWrapPolicy({Block}),
    "custom": lambda: CustomPolicy(lambda m: isinstance(m, (Block, nn.LayerNorm))),
}


def _units(model: nn.Module, wrapper: type[nn.Module]) -> list[str]:
    """Each unit's name in the unwrapped model (wrapper segments dropped), root first."""
    drop = {"module", "_fsdp_wrapped_module"}
    return sorted(
        ".".join(p for p in n.split(".") if p not in drop) for n, m in model.named_modules() if isinstance(m, wrapper)
    )


def compare(rank: int, world: int, name: str) -> tuple[list[str], list[str], float]:
    """Our units, FSDP1's, and the largest difference of their full state dicts after one step."""
    torch.manual_seed(0)
    ours_net, theirs_net = Net(), Net()
    theirs_net.load_state_dict(ours_net.state_dict())
    ours = FSDP(ours_net, auto_wrap_policy=POLICIES[name]())
    theirs = TorchFSDP(theirs_net, auto_wrap_policy=POLICIES[name](), device_id=torch.device("cpu"))  # type: ignore[arg-type]  # each entry is a policy FSDP1 accepts
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(x).square().mean().backward()
        opt.step()
    cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with TorchFSDP.state_dict_type(theirs, StateDictType.FULL_STATE_DICT, cfg):
        want = theirs.state_dict()
    got = ours.full_state_dict()
    diff = max(float((got[k] - v).abs().max()) for k, v in want.items())
    return _units(ours, FSDP), _units(theirs, TorchFSDP), diff


def compare_all(rank: int, world: int, _: None) -> dict[str, tuple[list[str], list[str], float]]:
    """``compare`` for every policy, in one world."""
    return {name: compare(rank, world, name) for name in POLICIES}


Compared = dict[int, list[dict[str, tuple[list[str], list[str], float]]]]


@pytest.fixture(scope="module")
def compared() -> Compared:
    return {world: run_world(world, compare_all, None, timeout=300) for world in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(POLICIES))
def test_torchs_policies_choose_fsdp1s_units(name: str, world: int, compared: Compared) -> None:
    for by_policy in compared[world]:
        ours, theirs, diff = by_policy[name]
        assert ours == theirs
        assert len(ours) > 1, "the policy wrapped nothing below the root"
        assert diff < 1e-6


def test_a_custom_policy_with_per_unit_arguments_is_refused() -> None:
    assert run_world(1, _refusal, None, timeout=60) == [
        "auto_wrap_policy: the policy gives units arguments of their own (sharding_strategy); every unit of "
        "a tree shares the constructor's arguments here, so return True instead"
    ]


def _refusal(rank: int, world: int, _: None) -> str:
    policy = CustomPolicy(lambda m: {"sharding_strategy": "NO_SHARD"} if isinstance(m, Block) else False)
    try:
        FSDP(Net(), auto_wrap_policy=policy)
    except ValueError as error:
        return str(error)
    return "accepted"
