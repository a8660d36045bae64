"""What real training scripts do, on a gloo world, against a single-process reference.

Each case trains a small model of its own (three wrapped blocks between a root-owned input
layer and head) for three SGD-with-momentum steps on every rank's batch, and the reference the
same model on all ranks' batches; the result is the largest difference of any state-dict entry.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.checkpoint import checkpoint

from fsdp_core import MixedPrecision, ShardingStrategy
from fsdp_shell import FSDP

STEPS = 3


@dataclass
class Output:
    """A forward's result as a dataclass (not a pytree node)."""

    loss: torch.Tensor
    logits: torch.Tensor


class Block(nn.Module):
    def __init__(self, d: int, checkpointed: bool) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.checkpointed = checkpointed

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(torch.relu(self.a(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            out = checkpoint(self.inner, x, use_reentrant=False)
            assert isinstance(out, torch.Tensor)
            return out
        return self.inner(x)


class Model(nn.Module):
    """Keyword-only inputs, an output chosen by ``kind``, optionally a head tied to the input layer."""

    def __init__(self, *, checkpointed: bool = False, output: str = "tensor", tied: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.blocks = nn.ModuleList([Block(6, checkpointed) for _ in range(3)])
        self.head = nn.Linear(6, 6)
        if tied:
            self.head.weight = self.inp.weight
        self.output = output

    def forward(self, *, x: torch.Tensor, y: torch.Tensor) -> object:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        loss = ((logits.float() - y) ** 2).mean()
        if self.output == "dataclass":
            return Output(loss, logits)
        if self.output == "dict":
            return {"loss": loss, "logits": logits}
        return loss


@dataclass(frozen=True)
class Habit:
    name: str
    use_orig_params: bool = False
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    checkpointed: bool = False
    checkpoint_wrapper: bool = False
    output: str = "tensor"
    tied: bool = False
    freeze: str = ""
    """"unit" (a whole wrapped block, before wrapping), "after" (the same, after wrapping),
    "some" (one weight of a block and the input layer's bias: LoRA-style)."""
    two_forwards: bool = False
    eval_between: bool = False


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)


def _all(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(_batch(step, r) for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


def _loss(out: object) -> torch.Tensor:
    if isinstance(out, Output):
        return out.loss
    loss = out["loss"] if isinstance(out, dict) else out
    assert isinstance(loss, torch.Tensor)
    return loss


def _forwards(
    model: nn.Module, habit: Habit, data: Callable[[int], tuple[torch.Tensor, torch.Tensor]], step: int
) -> torch.Tensor:
    x, y = data(step)
    loss = _loss(model(x=x, y=y))
    if habit.two_forwards:
        x2, y2 = data(step + 100)
        loss = loss + _loss(model(x=x2, y=y2))
    return loss


def run_habit(rank: int, world: int, habit: Habit) -> float:
    """Largest state-dict difference from the reference after ``STEPS`` steps."""
    torch.manual_seed(0)
    model = Model(checkpointed=habit.checkpointed, output=habit.output, tied=habit.tied)
    if habit.checkpoint_wrapper:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if habit.freeze == "unit":
        model.blocks[0].requires_grad_(False)
    if habit.freeze == "some":
        second = model.blocks[1]
        assert isinstance(second, Block)
        second.a.weight.requires_grad_(False)
        model.inp.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    kind = CheckpointWrapper if habit.checkpoint_wrapper else Block
    wrapped = FSDP(
        model, auto_wrap_policy={kind}, sharding_strategy=habit.strategy, use_orig_params=habit.use_orig_params
    )
    if habit.freeze == "after":
        inner = wrapped.module
        assert isinstance(inner, Model)
        inner.blocks[0].requires_grad_(False)
        ref.blocks[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for step in range(STEPS):
        torch.autograd.backward(_forwards(wrapped, habit, lambda s: _batch(s, rank), step))
        opt.step()
        opt.zero_grad()
        if habit.eval_between:
            wrapped.eval()
            with torch.no_grad():
                wrapped(x=_batch(step, rank)[0], y=_batch(step, rank)[1])
            wrapped.train()
            wrapped(x=_batch(step, rank)[0], y=_batch(step, rank)[1])
        torch.autograd.backward(_forwards(ref, habit, lambda s: _all(s, world), step))
        ref_opt.step()
        ref_opt.zero_grad()
    got, want = wrapped.state_dict(), ref.state_dict()
    assert list(got) == list(want), (list(got), list(want))
    return max(float((got[k] - v).abs().max()) for k, v in want.items())


def run_habits(rank: int, world: int, habits: tuple[Habit, ...]) -> dict[str, float]:
    return {h.name: run_habit(rank, world, h) for h in habits}


def scaler_steps(rank: int, world: int, _: None) -> dict[str, float]:
    """fp16 with torch's ``ShardedGradScaler``: an inf in rank 1's gradient skips the step on
    every rank and halves the scale; a finite step changes the parameters."""
    torch.manual_seed(0)
    model = FSDP(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
        auto_wrap_policy={nn.Linear},
        mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cpu", init_scale=1024.0)
    out: dict[str, float] = {}
    for name, poison in (("inf", rank == 1), ("finite", False)):
        before = model.state_dict()
        x = torch.randn(3, 4)
        if poison:
            x[0, 0] = float("inf")
        scaler.scale(model(x).float().sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        after = model.state_dict()
        out[f"{name}_changed"] = max(float((after[k] - before[k]).abs().max()) for k in before)
        out[f"{name}_scale"] = float(scaler.get_scale())
    return out


HABITS: tuple[Habit, ...] = (
    *tuple(
        dataclasses.replace(h, name=f"{h.name}-orig{o}", use_orig_params=o)
        for h in (
            Habit("plain"),
            Habit("tied", tied=True),
            Habit("tied-grad-op", tied=True, strategy=ShardingStrategy.SHARD_GRAD_OP),
            Habit("frozen-unit", freeze="unit"),
            Habit("frozen-after-wrapping", freeze="after"),
            Habit("checkpoint", checkpointed=True),
            Habit("checkpoint-wrapper", checkpoint_wrapper=True),
            Habit("two-forwards", two_forwards=True),
            Habit("eval-and-no-grad-between", eval_between=True),
            Habit("dataclass-output", output="dataclass"),
            Habit("dict-output", output="dict"),
            Habit("no-shard-checkpoint", strategy=ShardingStrategy.NO_SHARD, checkpointed=True),
        )
        for o in (False, True)
    ),
    Habit("frozen-beside-trainable-orig", freeze="some", use_orig_params=True),
)
