"""Step time, predicted then measured: gloo on loopback, the CPU runtime, per configuration.

Run on demand: ``python benchmarks/bench_step_time.py [--configs NAME,...] [--steps 20]``
(the configurations of ``benchmarks/bench_predict.py``).

The prediction is ``fsdp_core.sim.simulate_iteration`` of the model's real units
(``model_of_units``: their plans, the recorded all-gather orders, ``Executor.CPU_LANE``: where
the CPU runtime runs each op), plus the optimizer step. Its inputs are measured, each on its
own, none on the configuration it predicts:

- **compute**: each unit's forward and backward, the step run for real on every rank of the
  world at once (as they will train, sharing the machine), with FSDP's parameter views but none
  of its hooks' work (``time_trace``); the slowest rank's;
- **collectives**: every size the units' plans and all-gathers use, timed alone in the world
  that then trains, with the runtime's own gloo collectives; ``fit_table`` fits them
  (``CostModel.measured``); gloo runs a group's collectives side by side
  (``LinkModel(one_collective_per_group=False)``);
- **FSDP's host work per unit** (hooks, the plan interpreter): calibrated on a world of one
  rank training the same model: what its measured iteration takes beyond its simulated one
  without host work, scaled by how much slower compute runs in the world than alone, shared
  equally by the units, half in forward, half in backward;
- **the optimizer step**: ``step()`` and ``zero_grad()`` on tensors of the shapes each rank's
  optimizer steps (``optimized_tensors``), every rank at once.

Measured: the median over ``--steps`` steps (after warm-up) of each rank's forward + backward
and optimizer time, the worst rank. Printed: predicted / measured, per configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_memory import Config, _wrap, loss_of, net, optimizer_of
from benchmarks.bench_predict import CONFIGS, predict
from fsdp_core import Group, all_gather_volume, comm_volume
from fsdp_core.memory import optimized_tensors
from fsdp_core.memory.plan_memory import Executor
from fsdp_core.plan.planner import build_plan
from fsdp_core.sim import (
    Collective,
    CollectiveSample,
    CostModel,
    Link,
    LinkModel,
    fit_table,
    model_of_units,
    simulate_iteration,
)
from fsdp_shell import FSDP
from fsdp_shell.predict import Prediction
from fsdp_shell.predict.trace import TraceUnit, time_trace
from fsdp_shell.runtime.collectives import all_gather_flat
from fsdp_shell.runtime.cpu import gloo_receive_buffer, gloo_reduce_scatter
from fsdp_shell.units.build import find_units, param_names, unit_params
from tests.dist_harness import run_world

Size = tuple[Collective, Group, int, torch.dtype]
"""A collective, its group, the numel FSDP passes (all-gather: its output) and the dtype."""


def sizes(p: Prediction) -> list[Size]:
    """Every collective of one synchronising iteration: the units' all-gathers and their plans'."""
    out: dict[Size, None] = {}
    for u in p.units:
        if u is None:
            continue
        gather = all_gather_volume(u.request)
        if gather is not None:
            out[(Collective.ALL_GATHER, Group.SHARD, gather.output_numel, gather.dtype)] = None
        for v in comm_volume(build_plan(u.request)):
            out[(Collective(v.collective), v.group, v.input_numel, v.dtype)] = None
    return list(out)


def _time(run: object, repeats: int) -> float:
    """The median ms of ``run()`` over ``repeats``, every rank starting together."""
    assert callable(run)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _collective_ms(model: torch.nn.Module, size: Size, repeats: int) -> float:
    collective, group, numel, dtype = size
    assert isinstance(model, FSDP)
    groups = model._tree.groups
    pg = groups.of(group)
    n = pg.size()
    if collective is Collective.ALL_GATHER:
        out = torch.zeros(numel, dtype=dtype)
        mine = out.narrow(0, 0, numel // n).clone()
        return _time(lambda: _wait(all_gather_flat(out, mine, groups.gather_group, async_op=True)), repeats)
    if collective is Collective.REDUCE_SCATTER:
        src = torch.zeros(numel, dtype=dtype)
        dst = torch.zeros(numel // n, dtype=dtype)
        chunks = gloo_receive_buffer(src, may_overwrite_src=False)
        return _time(lambda: gloo_reduce_scatter(dst, src, pg, chunks).wait(), repeats)
    tensor = torch.zeros(numel, dtype=dtype)
    return _time(lambda: _wait(dist.all_reduce(tensor, group=pg, async_op=True)), repeats)


def _wait(work: object) -> None:
    wait = getattr(work, "wait", None)
    if callable(wait):
        wait()


@dataclasses.dataclass
class Measured:
    compute: list[tuple[float, float]]
    """Each unit's forward and backward ms, the step run here for real (``local_compute``),
    every rank at once."""
    optimizer_alone_ms: float
    """``optimizer_ms``, every rank at once."""
    collectives: list[float]
    """Per ``sizes`` entry, its median ms alone."""
    forward_backward_ms: float
    optimizer_ms: float


def measure(rank: int, world: int, job: tuple[Config, list[Size], int, int]) -> Measured:
    """The compute and the optimizer step without FSDP (every rank at once, as they will
    train), each collective alone, then ``steps`` training steps (after ``warmup``) timed."""
    cfg, wanted, steps, warmup = job
    p = predict(cfg)
    dist.barrier()
    compute = local_compute(cfg, p)
    optimizer_alone = optimizer_ms(cfg, p)
    model = _wrap("ours", cfg)
    opt = optimizer_of(cfg, model.parameters())
    collectives = [_collective_ms(model, s, 20) for s in wanted]
    forward_backward, optimizer = [], []
    for step in range(warmup + steps):
        for micro in range(cfg.accumulate):
            sync = micro == cfg.accumulate - 1
            dist.barrier()
            start = time.perf_counter()
            with contextlib.nullcontext() if sync else model.no_sync():  # type: ignore[operator]  # our wrapper
                loss = loss_of(model, cfg, rank, step)
                torch.autograd.backward(loss)
            if step >= warmup and sync:
                forward_backward.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        opt.step()
        opt.zero_grad()
        if step >= warmup:
            optimizer.append((time.perf_counter() - start) * 1e3)
    return Measured(
        compute, optimizer_alone, collectives, statistics.median(forward_backward), statistics.median(optimizer)
    )


def local_compute(cfg: Config, p: Prediction) -> list[tuple[float, float]]:
    """Each unit's forward and backward ms, the step run for real here (``time_trace``)."""
    with torch.device("meta"):
        module, _ = net(cfg)
    sites = find_units(module, p.options.wrap, lambda m: False)
    owned = unit_params(sites, param_names(module), lambda m: False)
    units = [
        TraceUnit(s.module, [o for o, _ in ow], None if u is None else u.request, u is not None and u.trainable)
        for s, ow, u in zip(sites, owned, p.units)
    ]
    seconds = time_trace(
        module, units, lambda m: loss_of(m, cfg, 0, 0), mixed_precision=p.options.mixed_precision, repeats=9
    )
    return [(f * 1e3, b * 1e3) for f, b in p.trace.unit_values(seconds, len(p.units), len(p.units) - 1)]


def optimizer_ms(cfg: Config, p: Prediction, repeats: int = 9) -> float:
    """``step()`` and ``zero_grad()`` of this rank's optimizer on tensors of its shapes."""
    params = [torch.nn.Parameter(torch.zeros(t.numel, dtype=t.dtype)) for t in optimized_tensors(p.units)]
    opt = optimizer_of(cfg, params)
    times = []
    for _ in range(repeats + 2):
        for param in params:
            param.grad = torch.zeros_like(param)
        start = time.perf_counter()
        opt.step()
        opt.zero_grad()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def simulate(p: Prediction, compute: list[tuple[float, float]], table: object, world: int) -> float:
    """The simulated iteration's ms."""
    assert isinstance(table, tuple)
    root = len(p.units) - 1
    model = model_of_units(
        p.units,
        p.trace,
        root=root,
        compute_ms=compute,
        cost=CostModel(measured=table),
        ranks_per_node=world,
        backward_prefetch=p.options.backward_prefetch,
        forward_prefetch=p.options.forward_prefetch,
        executor=Executor.CPU_LANE,
    )
    return simulate_iteration(model, LinkModel(one_collective_per_group=False)).iteration_ms


def samples(wanted: list[Size], ranks: list[Measured]) -> list[CollectiveSample]:
    """The worst rank's time of each collective, by the bytes FSDP passes, on the intra-node link."""
    out = []
    for k, (collective, _, numel, dtype) in enumerate(wanted):
        ms = max(r.collectives[k] for r in ranks)
        out.append(
            CollectiveSample(collective=collective, link=Link.INTRA_NODE, nbytes=max(1, numel * dtype.itemsize), ms=ms)
        )
    return out


def _worst(ranks: list[Measured]) -> list[tuple[float, float]]:
    """Each unit's compute, the slowest rank's."""
    return [(max(c[0] for c in column), max(c[1] for c in column)) for column in zip(*(r.compute for r in ranks))]


def run(cfg: Config, steps: int, warmup: int) -> tuple[float, float, str]:
    """(predicted, measured) ms per step of ``cfg``, and what went into the prediction."""
    p = predict(cfg)
    solo_cfg = dataclasses.replace(cfg, ranks=1)
    solo = predict(solo_cfg)
    wanted, solo_wanted = sizes(p), sizes(solo)
    (alone,) = run_world(1, measure, (solo_cfg, solo_wanted, steps, warmup), timeout=900)
    ranks = run_world(cfg.world, measure, (cfg, wanted, steps, warmup), timeout=900)
    bare = simulate(solo, alone.compute, fit_table(samples(solo_wanted, [alone])), 1)
    compute, compute_alone = _worst(ranks), alone.compute
    busy = sum(f + b for f, b in compute) / sum(f + b for f, b in compute_alone)
    host = max(0.0, alone.forward_backward_ms - bare) * busy
    share = host / sum(u is not None for u in p.units) / 2
    with_host = [(f + share, b + share) if u is not None else (f, b) for u, (f, b) in zip(p.units, compute)]
    iteration = simulate(p, with_host, fit_table(samples(wanted, ranks)), cfg.world)
    optimizer = max(r.optimizer_alone_ms for r in ranks)
    measured = max(r.forward_backward_ms + r.optimizer_ms for r in ranks)
    alone_ms = alone.forward_backward_ms
    parts = (
        f"compute {sum(f + b for f, b in compute):.2f} ({busy:.2f}x one rank's), host work {host:.2f} (one rank: "
        f"{alone_ms:.2f} measured, {bare:.2f} simulated without), iteration {iteration:.2f}, "
        f"optimizer {optimizer:.2f}; measured iteration {max(r.forward_backward_ms for r in ranks):.2f}, optimizer "
        f"{max(r.optimizer_ms for r in ranks):.2f}"
    )
    return iteration + optimizer, measured, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    for name in [n for n in args.configs.split(",") if n]:
        predicted, measured, parts = run(CONFIGS[name], args.steps, args.warmup)
        print(f"{name:<46} {predicted:>8.2f} / {measured:>8.2f} ms  {predicted / measured:.3f}  {parts}", flush=True)


if __name__ == "__main__":
    main()
