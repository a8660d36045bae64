"""The model, batches and reference training shared by the runtime's rank-side cases
(``runtime_*_cases.py``, run by ``test_runtime_gloo.py``).

``make_model`` stacks ``Layer`` units (each one FSDP unit) between an input layer and a head;
``train_against_reference`` trains an FSDP model on this rank's rows beside a plain
single-process ``nn.Module`` trained on every rank's rows, so the reference is computed without
any of the code under test, and returns the largest difference of any state-dict entry.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_shell import FSDP


class Layer(nn.Module):
    """One FSDP unit: a linear layer, a norm, a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.lin(x)))


def make_model(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    """An input layer, ``depth`` units, a head."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), *(Layer(width) for _ in range(depth)), nn.Linear(width, 1))


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s inputs (``rows`` x 8) and targets (``rows`` x 1), the same on every rank."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 1, generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One optimizer step on the mean squared error of ``model(x)`` against ``y``."""
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


# -- training against a single-process reference ------------------------------------------


def train_against_reference(model: FSDP, ref: nn.Module, rank: int, world: int, steps: int = 3) -> float:
    """``steps`` SGD-with-momentum steps of ``model`` on this rank's 3 rows and of ``ref`` on all
    ranks' rows; the largest difference of any state-dict entry after any step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    worst = 0.0
    rows = 3
    for step in range(steps):
        x, y = batch(step, rows * world)
        train_step(model, opt, x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
        train_step(ref, ropt, x, y)
        full = model.full_state_dict()
        worst = max(worst, *(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items()))
    return worst
