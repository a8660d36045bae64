"""The hybrid all-reduce really running while later backward compute runs, measured inside a gloo
world: the wall-clock intervals of each replicate all-reduce and of each unit's backward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_core import ShardingStrategy
from fsdp_shell import FSDP, fully_shard
from tests.worlds.runtime_cases import Layer, batch, train_step

# -- the hybrid all-reduce overlaps later backward compute ---------------------------------


class _Mark(torch.autograd.Function):
    """Identity whose backward records when gradient flows through it."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, label: tuple[int, str], marks: list[tuple[tuple[int, str], float]]
    ) -> torch.Tensor:
        ctx.label, ctx.marks = label, marks
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.marks.append((ctx.label, time.perf_counter()))
        return grad, None, None


class TimedLayer(Layer):
    """A ``Layer`` that records when its backward starts (gradient reaches its output) and
    ends (gradient has flowed back to its input)."""

    def __init__(self, width: int, marks: list[tuple[tuple[int, str], float]]) -> None:
        super().__init__(width)
        self.marks = marks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _Mark.apply(x, (id(self), "end"), self.marks)  # type: ignore[no-untyped-call]  # unannotated in torch
        out: torch.Tensor = _Mark.apply(super().forward(x), (id(self), "start"), self.marks)  # type: ignore[no-untyped-call]  # unannotated in torch
        return out


@dataclass
class Overlap:
    """Wall-clock intervals (perf_counter seconds) on one rank during one hybrid step."""

    all_reduces: list[tuple[float, float]] = field(default_factory=list)
    """Replicate-group all-reduces: issued, completed (as their waiter saw it)."""
    backward: list[tuple[float, float]] = field(default_factory=list)
    """Each unit's backward compute on the host thread."""


def hybrid_overlap(rank: int, world: int, api: str | None) -> Overlap:
    """One HYBRID_SHARD step (``world`` replicas of one rank each: on a 2-core machine more
    ranks only time-slice) of a model whose units take milliseconds of backward each; with
    ``api="fully_shard"`` each layer and the root through ``fsdp_shell.fully_shard`` on the same
    mesh instead of the FSDP1 API's wrapper."""
    torch.set_num_threads(1)
    width, depth, rows = 1024, 4, 256
    marks: list[tuple[tuple[int, str], float]] = []
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, width), *(TimedLayer(width, marks) for _ in range(depth)), nn.Linear(width, 1))
    model: nn.Module
    if api == "fully_shard":
        for unit in module:
            if isinstance(unit, TimedLayer):
                fully_shard(unit, mesh=mesh)
        fully_shard(module, mesh=mesh)
        model = module
    else:
        model = FSDP(
            module, sharding_strategy=ShardingStrategy.HYBRID_SHARD, auto_wrap_policy={TimedLayer}, device_mesh=mesh
        )
    replicate = mesh.get_group(0)
    seen = Overlap()
    issue = dist.all_reduce

    def timed_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = issue(tensor, *args, **kwargs)
        if kwargs.get("group") is not replicate or work is None:
            return work
        return _TimedWork(work, seen.all_reduces)

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(2):
        train_step(model, opt, *batch(step, rows))
    for step in range(2, 2 + MEASURED_STEPS):
        dist.barrier()
        marks.clear()
        dist.all_reduce = timed_all_reduce
        try:
            x, y = batch(step, rows)
            ((model(x) - y) ** 2).mean().backward()
        finally:
            dist.all_reduce = issue
        begun: dict[int, float] = {}
        for (layer, what), t in marks:
            if what == "start":
                begun[layer] = t
            else:
                seen.backward.append((begun[layer], t))
        opt.zero_grad()
    return seen


MEASURED_STEPS = 3


class _TimedWork:
    def __init__(self, work: dist.Work, log: list[tuple[float, float]]) -> None:
        self._work, self._log, self._issued = work, log, time.perf_counter()

    def wait(self, timeout: Any = None) -> bool:
        done = bool(self._work.wait())
        self._log.append((self._issued, time.perf_counter()))
        return done
