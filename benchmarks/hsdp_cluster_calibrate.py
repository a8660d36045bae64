"""HSDP cluster benchmark, its calibration: what the iteration simulator needs, timed on each
rank of the cluster: every collective FSDP issues, alone and beside what runs beside it in
training, and each unit's compute inside training
(``benchmarks/bench_hsdp_cluster.py``'s docstring says what and why)."""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.hsdp_cluster_seed import D_MODEL, FF, HEADS, build
from fsdp_core.sim import (
    Collective,
    CollectiveSample,
    Link,
    Load,
    MeasuredUnit,
    Measurements,
    SharingSample,
    SlowdownSample,
)
from fsdp_shell import FSDP

REPEATS = 9
"""Timed calls per figure in ``calibrate`` (and as many untimed ones before each collective's)."""


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
    units, outside, spans = _unit_compute(build("ours-hybrid-async", mesh), repeats, shape, rank)
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
