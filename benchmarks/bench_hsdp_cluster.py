"""The seed's table on an emulated two-node cluster: FSDP vs old (sync) HSDP vs async HSDP.

Run on demand, as root: ``python benchmarks/bench_hsdp_cluster.py [--rounds 6] [--rate 1000]
[--calibrate] [--trace DIR]``. ``--loopback`` runs the same on plain loopback (no namespaces, no rate limit)
as a smoke test.

The default link, 1000 Mbit/s, puts one block's inter-node all-reduce at about 10x its
intra-node reduce-scatter, as on the seed's cluster (30-55 ms against 3-5 ms); at 400 Mbit/s
the all-reduce is some 25x the reduce-scatter on this machine and the link alone sets the pace,
so where the all-reduce runs barely matters (measured: async/sync 0.98).

Two network namespaces joined by a rate-limited veth pair (``benchmarks/cluster.py``), two
gloo ranks per "node". A communication-bound transformer (6 encoder blocks, d_model 256,
0.79 M parameters each; a small batch, so gradient traffic over the limited link dominates)
trains one step per configuration per round, interleaved, each step timed between barriers:

- ours ``FULL_SHARD`` over all 4 ranks (its all-gathers and reduce-scatters cross the link);
- ours ``HYBRID_SHARD`` with ``hybrid_all_reduce="sync"`` (the replicate all-reduce after each
  reduce-scatter, as FSDP1 before PyTorch PR 106080) and ``"async"`` (the default);
- PyTorch FSDP1 ``HYBRID_SHARD`` and ``FULL_SHARD`` on the same cluster.

Shard groups are the two ranks of one node, replicate groups span the nodes. Printed: median
ms/iteration (with the interquartile range over rounds, worst rank) and the seed's ratios
(async vs sync, async vs FSDP, async vs FSDP1's HSDP). With ``--trace DIR``, one more
``FULL_SHARD``, sync and async iteration each run under ``torch.profiler`` (every thread; the
profiler slows them by a third or more) and every rank writes a Perfetto-readable trace
(``DIR/<config>-rank<r>.json``).

``--calibrate`` then predicts our three configurations with the iteration simulator
(``fsdp_core.simulate_iteration``) from timings taken on the same cluster, none fitted to an
iteration time (``calibrate``; every number a mean over repeats and over the four ranks):

- every collective FSDP issues, alone, at two sizes, as the runtime issues it
  (``model_from_measurements`` fits latency + bytes / bandwidth to them);
- each block's forward and backward compute inside training (the mean rank's, and the slowest
  rank's in each step: both predictions are printed);
- how the processor shared by four ranks on two cores slows collectives
  (``links_from_measurements``): each collective beside every rank's compute (the
  ``LinkModel.compute_slowdown`` of each collective: measured 1.2x to 5x), the intra-node ones
  beside an inter-node all-reduce (``cross_link_slowdown``; about 1.0-1.2x, and the all-reduce
  beside intra-node traffic not slowed, so the model slows only the intra-node side), and the
  all-gather and reduce-scatter of one group issued together, as gloo runs them side by side
  (``contention``, about 1.1);
- what the timed step does outside the simulated iteration (the input, the optimizer step,
  ``zero_grad``, the closing barrier), added to each prediction.

It prints them, the simulated and measured ms/iteration and their ratio; with ``--trace`` it also
writes ``calibration.json`` and each simulated iteration as a chart and a Perfetto trace
(``DIR/simulated-<config>.{txt,json}``) beside the profiled ones. See docs/async-hsdp.md for what
it predicts and what the model still leaves out.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_core import HybridAllReduce, ShardingStrategy
from fsdp_core.sim import (
    Collective,
    CollectiveSample,
    IterationTimeline,
    Link,
    Load,
    MeasuredUnit,
    Measurements,
    SharingSample,
    SlowdownSample,
    format_iteration,
    iteration_to_trace,
    links_from_measurements,
    model_from_measurements,
    simulate_iteration,
    unit_plans,
)
from fsdp_shell import FSDP

D_MODEL, HEADS, FF, BLOCKS = 256, 4, 1024, 6

CONFIGS = ("fsdp1-full", "ours-full", "fsdp1-hybrid", "ours-hybrid-sync", "ours-hybrid-async")


class Model(nn.Module):
    """Embedding-free transformer: an input projection, ``BLOCKS`` encoder layers, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, D_MODEL)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True) for _ in range(BLOCKS)
        )
        self.head = nn.Linear(D_MODEL, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def _build(config: str, mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    module = Model()
    if config.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        hybrid = config.endswith("hybrid")
        return FullyShardedDataParallel(
            module,
            auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}),
            device_id=torch.device("cpu"),
            sharding_strategy=TorchStrategy.HYBRID_SHARD if hybrid else TorchStrategy.FULL_SHARD,
            device_mesh=mesh if hybrid else None,
        )
    if config == "ours-full":
        return FSDP(module, auto_wrap_policy={nn.TransformerEncoderLayer})
    placement = config.rsplit("-", 1)[1]
    return FSDP(
        module,
        auto_wrap_policy={nn.TransformerEncoderLayer},
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_mesh=mesh,
        hybrid_all_reduce=placement,
    )


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, shape: tuple[int, int]) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(*shape, 32, generator=g), torch.randn(*shape, 1, generator=g)
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach().item())


def seed_table(rank: int, world: int, arg: tuple[int, int, str | None, tuple[int, int]]) -> dict[str, list[float]]:
    """Per-round step times (s) of every configuration on this rank, interleaved; with a trace
    directory, one profiled sync and async iteration each. ``shape``: (batch, sequence)."""
    rounds, warmup, trace_dir, shape = arg
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    models = {c: _build(c, mesh) for c in CONFIGS}
    opts = {c: torch.optim.SGD(m.parameters(), lr=1e-3) for c, m in models.items()}
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for r in range(warmup + rounds):
        for config, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            _step(model, opts[config], r, rank, shape)
            dist.barrier()
            if r >= warmup:
                times[config].append(time.perf_counter() - start)
    if trace_dir is not None:
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerActivity, profile

        every_thread = _ExperimentalConfig(profile_all_threads=True)  # the lane issues the all-reduces
        for config in ("ours-full", "ours-hybrid-sync", "ours-hybrid-async"):
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
                _step(models[config], opts[config], warmup + rounds, rank, shape)
            prof.export_chrome_trace(str(Path(trace_dir) / f"{config}-rank{rank}.json"))
    del models, opts
    gc.collect()
    return times


def _mean_ms(fn: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """Mean ms of ``repeats`` calls of ``fn``, each after a barrier, after ``warmup`` untimed
    ones (means, not medians: the simulator adds durations, and on two shared cores they have
    long tails; the mean of a sum is the sum of the means, the median is not)."""
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.fmean(times)


Started = Callable[[], Callable[[], None]]
"""Issues a collective; returns what waits for it to land."""


def _block_collectives(
    numel: int, groups: dict[str, dist.ProcessGroup], replicate: dist.ProcessGroup
) -> dict[tuple[str, str], tuple[int, Started]]:
    """Every collective FSDP issues for a unit of ``numel`` parameters, as the runtime issues it:
    the all-gather into a fresh buffer (an unshard allocates one), the reduce-scatter by
    ``fsdp_shell.runtime.cpu.gloo_reduce_scatter``, the replicate all-reduce of one shard. Keys
    (collective, link); values (bytes as ``CollectiveSample.nbytes`` counts them, the issuer)."""
    from fsdp_shell.runtime.collectives import all_gather_flat
    from fsdp_shell.runtime.cpu import gloo_reduce_scatter

    def waiter(work: dist.Work | None) -> Callable[[], None]:
        assert work is not None

        def wait() -> None:
            work.wait()

        return wait

    out: dict[tuple[str, str], tuple[int, Started]] = {}
    part = torch.randn(-(-numel // 2))
    out[("all_reduce", "inter_node")] = (
        part.numel() * 4,
        lambda: waiter(dist.all_reduce(part, group=replicate, async_op=True)),
    )
    for link, group in groups.items():
        size = group.size()
        padded = -(-numel // size) * size
        full, shard = torch.randn(padded), torch.randn(padded // size)

        def gather(
            group: dist.ProcessGroup = group, padded: int = padded, shard: torch.Tensor = shard
        ) -> Callable[[], None]:
            return waiter(all_gather_flat(torch.empty(padded), shard, group, async_op=True))

        def scatter(
            group: dist.ProcessGroup = group, full: torch.Tensor = full, size: int = size
        ) -> Callable[[], None]:
            return gloo_reduce_scatter(torch.empty(full.numel() // size), full, group, torch.empty_like(full)).wait

        out[("all_gather", link)] = (padded * 4, gather)
        out[("reduce_scatter", link)] = (padded * 4, scatter)
    return out


Spans = tuple[tuple[tuple[float, ...], tuple[float, ...]], ...]
"""Per block, its forward's and its backward's ms in each timed step (``_unit_compute``)."""


def calibrate(rank: int, world: int, arg: tuple[int, tuple[int, int]]) -> tuple[Measurements, float, Spans]:
    """What the simulator needs, timed on this rank of the cluster (means of ``repeats``):

    - every collective FSDP issues, alone, at two sizes (a block's flat parameter and a quarter
      of it), as the runtime issues it (``_block_collectives``), after as many untimed calls:
      a group's first large collectives after the world starts are slow and speed up over
      several calls (the 3 MiB intra-node all-gather here: 50 ms, then 33, 25, 25, 15, ... 7),
      as they are not in training after its warm-up steps;
    - how much what runs beside a collective in training slows it (``_interference``);
    - each unit's forward and backward compute inside training (``_unit_compute``);

    and what the measured step adds to the simulated iteration (the input, the optimizer step,
    ``zero_grad``, the closing barrier), in ms; and each block's compute per step."""
    repeats, shape = arg
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    groups = {"intra_node": mesh.get_group(1), "inter_node": _world()}
    replicate = mesh.get_group(0)
    block_numel = sum(p.numel() for p in nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, batch_first=True).parameters())
    samples = []
    for numel in (block_numel, block_numel // 4):
        for (collective, link), (nbytes, start) in _block_collectives(numel, groups, replicate).items():
            samples.append(
                CollectiveSample(
                    collective=Collective(collective),
                    link=Link(link),
                    nbytes=nbytes,
                    ms=_mean_ms(functools.partial(_issue_and_wait, start), repeats, warmup=repeats),
                )
            )
    block = {key: start for key, (_, start) in _block_collectives(block_numel, groups, replicate).items()}
    slowdowns, sharing = _interference(block, repeats)
    units, outside, spans = _unit_compute(_build("ours-hybrid-async", mesh), repeats, shape, rank)
    return (
        Measurements(units=units, samples=tuple(samples), ranks_per_node=2, slowdowns=slowdowns, sharing=sharing),
        outside,
        spans,
    )


def _issue_and_wait(start: Started) -> None:
    start()()


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    return group


def _interference(
    block: dict[tuple[str, str], Started], repeats: int
) -> tuple[tuple[SlowdownSample, ...], tuple[SharingSample, ...]]:
    """A block's collectives timed alone and beside what runs beside them in training:

    - ``Load.OTHER_LINK``: the intra-node all-gather and reduce-scatter while the replicate
      all-reduce is in flight across the nodes (issued just before them); and that all-reduce
      while a second thread keeps the intra-node group busy (reduce-scatters and all-gathers,
      longer than it);
    - ``Load.COMPUTE``: every collective while a second thread on every rank runs a block's
      forward and backward over and over (torch releases the GIL inside its ops), as the ranks'
      backward runs beside the prefetched all-gather, the reduce-scatter and the all-reduce;
    - sharing: the all-gather and the reduce-scatter of one group issued together (gloo runs a
      group's collectives side by side, as in FSDP's backward), until the later lands.

    Means of ``repeats``. Every process group is driven by one thread, in the same order on
    every rank."""
    import threading

    def timed(start: Started) -> float:
        begin = time.perf_counter()
        start()()
        return (time.perf_counter() - begin) * 1e3

    compute = nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True)
    x = torch.randn(4, 16, D_MODEL)

    def busy(stop: threading.Event) -> None:
        while not stop.is_set():
            compute(x).sum().backward()

    def intra_traffic(rounds: int) -> None:
        for _ in range(rounds):
            block[("reduce_scatter", "intra_node")]()()
            block[("all_gather", "intra_node")]()()

    alone: dict[tuple[str, str], list[float]] = {key: [] for key in block}
    loaded: dict[tuple[Load, str, str], list[float]] = {}
    together: dict[str, list[float]] = {"intra_node": [], "inter_node": []}
    for _ in range(repeats):
        for key, start in block.items():
            dist.barrier()
            alone[key].append(timed(start))
            dist.barrier()
            stop = threading.Event()
            worker = threading.Thread(target=busy, args=(stop,))
            worker.start()
            loaded.setdefault((Load.COMPUTE, *key), []).append(timed(start))
            stop.set()
            worker.join()
        for key in (("all_gather", "intra_node"), ("reduce_scatter", "intra_node")):
            dist.barrier()
            wait_all_reduce = block[("all_reduce", "inter_node")]()
            loaded.setdefault((Load.OTHER_LINK, *key), []).append(timed(block[key]))
            wait_all_reduce()
        dist.barrier()
        traffic = threading.Thread(target=intra_traffic, args=(6,))  # 6 pairs outlast one all-reduce
        begin = time.perf_counter()
        wait_all_reduce = block[("all_reduce", "inter_node")]()
        traffic.start()
        wait_all_reduce()
        loaded.setdefault((Load.OTHER_LINK, "all_reduce", "inter_node"), []).append((time.perf_counter() - begin) * 1e3)
        traffic.join()
        for link in together:
            dist.barrier()
            begin = time.perf_counter()
            wait_gather = block[("all_gather", link)]()
            block[("reduce_scatter", link)]()()
            wait_gather()
            together[link].append((time.perf_counter() - begin) * 1e3)
    slowdowns = tuple(
        SlowdownSample(
            load=load,
            collective=Collective(collective),
            link=Link(link),
            alone_ms=statistics.fmean(alone[(collective, link)]),
            loaded_ms=statistics.fmean(values),
        )
        for (load, collective, link), values in loaded.items()
    )
    sharing = tuple(
        SharingSample(
            link=Link(link),
            first_ms=statistics.fmean(alone[("all_gather", link)]),
            second_ms=statistics.fmean(alone[("reduce_scatter", link)]),
            together_ms=statistics.fmean(values),
        )
        for link, values in together.items()
    )
    return slowdowns, sharing


def _unit_compute(
    model: nn.Module, steps: int, shape: tuple[int, int], rank: int, warmup: int = 2
) -> tuple[tuple[MeasuredUnit, ...], float, Spans]:
    """Each unit's forward and backward compute as it runs inside training on this cluster
    (so with the other ranks' compute and the collectives competing for the cores), means over
    ``steps`` steps after ``warmup`` (a new model's first steps allocate and initialise):

    - forward: from the block's forward pre-hook (its all-gather has landed) to the end of its
      FSDP unit's forward (its post-forward reshard done);
    - backward: from the block's output gradient (after the unit's pre-backward) to its flat
      parameter's gradient being ready, just before the post-backward hook reduces it: the
      weight gradients and their assembly into the flat gradient included, which run after the
      block's input gradient (its ``full_backward_hook``): 0.4-1.2 ms more here.

    The root's own layers (an input projection, a one-output head) cost next to nothing and are
    left at 0. Also what the measured step spends outside the simulated iteration: the input,
    the optimizer step and ``zero_grad``, and a barrier (the benchmark times each step up to
    one); its mean in ms. And each block's forward and backward ms in every step (``Spans``)."""
    blocks = [m for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    wrappers = {id(getattr(m, "module", None)): m for m in model.modules() if isinstance(m, FSDP)}
    marks: dict[tuple[int, str], list[float]] = {}

    def mark(i: int, what: str) -> Callable[..., None]:
        return lambda *_: marks.setdefault((i, what), []).append(time.perf_counter())

    def watch_gradient(i: int, block: nn.TransformerEncoderLayer) -> Callable[..., None]:
        watched: list[torch.Tensor] = []

        def at_forward(*_: object) -> None:
            if not watched:  # the unit's flat parameter, the base of the views the block uses now
                flat = block.linear1.weight._base
                assert isinstance(flat, torch.Tensor)
                flat.register_hook(mark(i, "grad"))  # type: ignore[no-untyped-call]  # unannotated in torch
                watched.append(flat)
            mark(i, "f0")()

        return at_forward

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(watch_gradient(i, block))
        wrappers[id(block)].register_forward_hook(mark(i, "f1"))
        block.register_full_backward_pre_hook(mark(i, "b0"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    outside = []
    for step in range(-warmup, steps):
        if step == 0:
            marks.clear()
        dist.barrier()
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(*shape, 32, generator=g), torch.randn(*shape, 1, generator=g)
        t1 = time.perf_counter()
        (model(x) - y).square().mean().backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        dist.barrier()
        t4 = time.perf_counter()
        dist.barrier()
        if step >= 0:
            outside.append((t1 - t0 + t3 - t2 + time.perf_counter() - t4) * 1e3)

    def per_step(i: int, a: str, b: str) -> tuple[float, ...]:
        return tuple((e - s) * 1e3 for s, e in zip(marks[(i, a)], marks[(i, b)]))

    def span(i: int, a: str, b: str) -> float:
        return statistics.fmean(per_step(i, a, b))

    numel = sum(p.numel() for p in nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, batch_first=True).parameters())
    root_numel = (32 + 1) * D_MODEL + D_MODEL + 1
    units = (
        MeasuredUnit(name="root", param_bytes=root_numel * 4, forward_ms=0.0, backward_ms=0.0),
        *(
            MeasuredUnit(
                name=f"block{i}",
                param_bytes=numel * 4,
                forward_ms=span(i, "f0", "f1"),
                backward_ms=span(i, "b0", "grad"),
            )
            for i in range(len(blocks))
        ),
    )
    spans = tuple((per_step(i, "f0", "f1"), per_step(i, "b0", "grad")) for i in range(len(blocks)))
    return units, statistics.fmean(outside), spans


def slowest_rank(measured: Measurements, per_rank: Sequence[Spans]) -> Measurements:
    """``measured`` with each block's forward and backward the mean over steps of the slowest
    rank's in that step: a collective starts when the last rank of its group reaches it, so in a
    step each block costs its slowest rank's time, and a different rank may be slowest in each."""

    def worst(column: Sequence[tuple[float, ...]]) -> float:
        return statistics.fmean(max(step) for step in zip(*column))

    blocks = [
        dataclasses.replace(
            unit,
            forward_ms=worst([spans[i][0] for spans in per_rank]),
            backward_ms=worst([spans[i][1] for spans in per_rank]),
        )
        for i, unit in enumerate(measured.units[1:])
    ]
    return dataclasses.replace(measured, units=(measured.units[0], *blocks))


R = TypeVar("R")


def _mean_record(records: Sequence[R]) -> R:
    """``records[0]`` with each float field the mean over ``records`` (one per rank, each the
    same record timed there) and each tuple of records averaged the same way."""
    first = records[0]
    if not dataclasses.is_dataclass(first):
        return first
    changes: dict[str, object] = {}
    for field in dataclasses.fields(first):
        values = [getattr(r, field.name) for r in records]
        if isinstance(values[0], float):
            changes[field.name] = statistics.fmean(values)
        elif isinstance(values[0], tuple):
            changes[field.name] = tuple(_mean_record(column) for column in zip(*values))
    return dataclasses.replace(first, **changes)  # type: ignore[type-var]


def _simulate(measured: Measurements) -> dict[str, IterationTimeline]:
    """The simulated iteration of our three configurations from the calibration, each with the
    post-backward plans it runs (2 nodes of ``ranks_per_node``)."""
    world = 2 * measured.ranks_per_node
    units = len(measured.units)
    plans = {
        "ours-full": unit_plans(units, ShardingStrategy.FULL_SHARD, world),
        "ours-hybrid-sync": unit_plans(
            units, ShardingStrategy.HYBRID_SHARD, world, measured.ranks_per_node, hybrid_all_reduce=HybridAllReduce.SYNC
        ),
        "ours-hybrid-async": unit_plans(units, ShardingStrategy.HYBRID_SHARD, world, measured.ranks_per_node),
    }
    # gloo runs a group's asynchronous collectives side by side on its worker threads: FSDP's
    # backward all-gather and reduce-scatter of one group overlap (and share their link).
    links = links_from_measurements(measured, one_collective_per_group=False)
    return {config: simulate_iteration(model_from_measurements(measured, p), links) for config, p in plans.items()}


def _write_simulated(
    directory: Path, measurements: Measurements, outside: float, simulated: dict[str, IterationTimeline]
) -> None:
    """Beside the profiled traces: ``calibration.json`` (what was measured, means over ranks) and
    each simulated iteration as a chart (``simulated-<config>.txt``) and a Perfetto trace
    (``simulated-<config>.json``)."""

    def plain(value: object) -> object:
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    record = {"measurements": plain(dataclasses.asdict(measurements)), "outside_ms": outside}
    (directory / "calibration.json").write_text(json.dumps(record, indent=1) + "\n")
    for config, timeline in simulated.items():
        (directory / f"simulated-{config}.txt").write_text(format_iteration(timeline, width=120) + "\n")
        (directory / f"simulated-{config}.json").write_text(json.dumps(iteration_to_trace(timeline, name=config)))


def _report(per_rank: list[dict[str, list[float]]], rounds: int) -> dict[str, float]:
    worst = {c: [max(r[c][i] for r in per_rank) * 1e3 for i in range(rounds)] for c in CONFIGS}
    med = {c: statistics.median(v) for c, v in worst.items()}
    for c in CONFIGS:
        q = statistics.quantiles(worst[c], n=4) if rounds > 1 else [med[c], med[c], med[c]]
        print(f"  {c:<18} {med[c]:8.1f} ms/iter  [IQR {q[0]:.0f}-{q[2]:.0f}]")

    def ratio(a: str, b: str) -> str:
        per_round = [x / y for x, y in zip(worst[a], worst[b])]
        return f"{statistics.median(per_round):.2f}"

    print(f"  async / sync HSDP (ours): {ratio('ours-hybrid-async', 'ours-hybrid-sync')}   (seed: 597/665 = 0.90)")
    print(f"  async HSDP / FSDP (ours): {ratio('ours-hybrid-async', 'ours-full')}   (seed: 597/1160 = 0.51)")
    print(f"  async HSDP / FSDP1 HSDP:  {ratio('ours-hybrid-async', 'fsdp1-hybrid')}")
    print(f"  sync HSDP / FSDP1 HSDP:   {ratio('ours-hybrid-sync', 'fsdp1-hybrid')}")
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rate", type=float, default=1000.0, help="inter-node link, Mbit/s (default 1000)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument(
        "--trace",
        default=None,
        help="write per-rank Perfetto traces of one FULL_SHARD, sync and async step "
        "(with --calibrate also the simulated ones)",
    )
    parser.add_argument("--loopback", action="store_true", help="plain loopback, no emulated link (smoke test)")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="also time every collective alone and each unit's compute, and print what the "
        "iteration simulator (fsdp_core.simulate_iteration) predicts beside the measurements",
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    trace = None if args.trace is None else str(Path(args.trace).resolve())
    if trace is not None:
        Path(trace).mkdir(parents=True, exist_ok=True)
    shape = (args.batch, args.seq)
    arg = (args.rounds, args.warmup, trace, shape)
    run: Callable[[Callable[[int, int, object], object], object], list[object]]
    if args.loopback:
        from fsdp_shell.cli.launch import run_world

        run = lambda fn, a: run_world(4, fn, a, timeout=3600)  # noqa: E731
        where = "plain loopback, 4 ranks"
    else:
        from benchmarks.cluster import cluster_available, run_on_cluster

        reason = cluster_available()
        if reason is not None:
            sys.exit(f"bench_hsdp_cluster: {reason}")
        run = lambda fn, a: run_on_cluster(fn, a, rate_mbit=args.rate, ranks_per_node=2, timeout=3600)  # noqa: E731
        where = f"2 nodes x 2 ranks, {args.rate:g} Mbit/s between the nodes"
    print(
        f"{where}; {BLOCKS} encoder blocks of 0.79 M parameters, batch {args.batch} x {args.seq}; "
        f"{args.rounds} interleaved rounds after {args.warmup} warm-up; median of per-round worst-rank times"
    )
    measured = _report(run(seed_table, arg), args.rounds)  # type: ignore[arg-type]
    if args.calibrate:
        per_rank = cast(list[tuple[Measurements, float, Spans]], run(calibrate, (9, shape)))  # type: ignore[arg-type]
        measurements = _mean_record([m for m, _, _ in per_rank])
        outside = statistics.fmean(o for _, o, _ in per_rank)
        slowest = slowest_rank(measurements, [spans for _, _, spans in per_rank])
        print(
            "  collectives alone (mean of 9, mean over ranks): "
            + "; ".join(
                f"{s.collective.value} {s.link.value} {s.nbytes / 2**20:.2f} MiB {s.ms:.1f} ms"
                for s in measurements.samples
            )
        )
        print(
            "  beside a load (alone -> loaded ms): "
            + "; ".join(
                f"{s.collective.value} {s.link.value} | {s.load.value} {s.alone_ms:.1f} -> {s.loaded_ms:.1f}"
                for s in measurements.slowdowns
            )
        )
        print(
            "  all-gather + reduce-scatter of one group, alone -> together (ms): "
            + "; ".join(
                f"{s.link.value} {s.first_ms:.1f} + {s.second_ms:.1f} -> {s.together_ms:.1f}"
                for s in measurements.sharing
            )
        )
        print(
            "  compute per unit (fwd/bwd ms): "
            + ", ".join(f"{u.name} {u.forward_ms:.1f}/{u.backward_ms:.1f}" for u in measurements.units)
        )
        print(
            "  compute per unit, the slowest rank's in each step (fwd/bwd ms): "
            + ", ".join(f"{u.name} {u.forward_ms:.1f}/{u.backward_ms:.1f}" for u in slowest.units)
        )
        simulated = _simulate(measurements)
        links = simulated["ours-full"].links
        c = links.compute_slowdown
        print(
            f"  measured link model: cross_link_slowdown {links.cross_link_slowdown:.2f}; beside compute: "
            f"all-gather {c.all_gather_intra:.2f} intra / {c.all_gather_inter:.2f} inter, reduce-scatter "
            f"{c.reduce_scatter_intra:.2f} / {c.reduce_scatter_inter:.2f}, all-reduce {c.all_reduce_inter:.2f}; "
            f"contention {links.contention:.2f} (collectives of one group side by side, as gloo runs them)"
        )
        print(
            f"  outside the simulated iteration (input, optimizer step, zero_grad, barrier): {outside:.1f} ms, "
            f"added to each prediction"
        )
        for compute, timelines in (("the mean rank", simulated), ("the slowest rank per step", _simulate(slowest))):
            for config, timeline in timelines.items():
                ms = timeline.iteration_ms + outside
                print(
                    f"  simulated {config:<18} {ms:8.1f} ms/iter   measured {measured[config]:8.1f}   "
                    f"simulated/measured {ms / measured[config]:.2f}   (compute of {compute})"
                )
        if trace is not None:
            _write_simulated(Path(trace), measurements, outside, simulated)
    if trace is not None:
        print(
            f"  traces: {trace}/ours-{{full,hybrid-sync,hybrid-async}}-rank<r>.json (open in ui.perfetto.dev)"
            + (
                f"; simulated: {trace}/simulated-<config>.{{txt,json}}, {trace}/calibration.json"
                if args.calibrate
                else ""
            )
        )


if __name__ == "__main__":
    main()
