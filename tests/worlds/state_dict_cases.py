"""State-dict semantics on a gloo world: the unwrapped module's keys and nn.Module's loading rules."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig
from torch.distributed.fsdp import StateDictType as TorchStateDictType

from fsdp_shell import FSDP


class Counter(nn.Module):
    """A module with extra state (an int) and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(4), persistent=False)
        self.register_buffer("seen", torch.zeros(()))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.lin(x)
        return out

    def get_extra_state(self) -> object:
        return {"calls": self.calls}

    def set_extra_state(self, state: object) -> None:
        assert isinstance(state, dict)
        self.calls = int(state["calls"])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)
        self.body = nn.Sequential(Counter(), nn.Tanh(), Counter())
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.body(self.embed(x)))
        return out


def semantics(rank: int, world: int, _: None) -> dict[str, object]:
    """What ``state_dict`` / ``load_state_dict`` return, checked against the unwrapped module's."""
    torch.manual_seed(0)
    plain = Net()
    keys = list(plain.state_dict())
    model = FSDP(Net(), auto_wrap_policy={Counter})
    model.load_state_dict(plain.state_dict())
    model(torch.randn(2, 4))
    out: dict[str, object] = {"keys": list(model.state_dict()) == keys}
    full = model.state_dict()
    out["extra"] = full["body.0._extra_state"]
    out["tied"] = torch.equal(full["embed.weight"], full["head.weight"])
    out["loaded"] = all(
        torch.equal(full[k], v) for k, v in plain.state_dict().items() if not k.endswith("_extra_state")
    )

    with FSDP.state_dict_type(
        model, TorchStateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ):
        rank0 = model.state_dict()
    out["rank0_only_len"] = len(rank0)
    out["back_to_default"] = list(model.state_dict()) == keys

    partial: dict[str, object] = {
        k: v + 1.0 for k, v in full.items() if k.startswith("body.2.") and isinstance(v, torch.Tensor)
    }
    partial["body.2._extra_state"] = {"calls": 7}
    result = model.load_state_dict(partial, strict=False)
    out["missing"] = sorted(result.missing_keys)
    out["unexpected"] = sorted(result.unexpected_keys)
    after = model.state_dict()
    out["partial_applied"] = all(torch.equal(after[k], v) for k, v in partial.items() if isinstance(v, torch.Tensor))
    out["extra_loaded"] = after["body.2._extra_state"]
    out["rest_kept"] = all(
        torch.equal(after[k], v) for k, v in full.items() if k not in partial and not k.endswith("_extra_state")
    )
    try:
        model.load_state_dict({**full, "nonsense": torch.zeros(1)})
        out["strict_error"] = ""
    except RuntimeError as exc:
        out["strict_error"] = str(exc)
    dist.barrier()
    return out
