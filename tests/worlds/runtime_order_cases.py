"""Collectives in the same order on every rank whatever the timing, measured inside gloo worlds:
each all-gather prefetch setting's gathered units and shard-group collectives, and training
under slow links (``slow_links``: completions at rank-dependent times) against the
single-process reference, with every rank's collective log.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp_core import Group, ShardingStrategy
from fsdp_shell import FSDP
from fsdp_shell.runtime.collectives import CollectiveRecord, Phase
from fsdp_shell.units.flat_param import FlatParamHandle
from tests.worlds.runtime_cases import Layer, make_model, train_against_reference

# -- all-gather prefetch --------------------------------------------------------------------


@dataclass
class Prefetched:
    """One prefetch configuration's last training step on one rank."""

    ref_diff: float = 0.0
    max_gathered: dict[str, int] = field(default_factory=dict)
    """Per phase (forward, backward): most non-root units unsharded or in flight at once."""
    backward_ops: list[tuple[str, Phase]] = field(default_factory=list)
    """The shard group's collectives during the last backward, as (op, phase)."""


def prefetch_cases(rank: int, world: int, arg: None) -> dict[str, Prefetched]:
    """Every ``backward_prefetch`` with and without ``forward_prefetch``: FULL_SHARD trains like
    the reference; the gathered units and the order of all-gathers are recorded."""
    torch.set_num_threads(1)
    out = {}
    for backward_prefetch in ("BACKWARD_PRE", "BACKWARD_POST", None):
        for forward_prefetch in (False, True):
            name = f"{backward_prefetch}-forward{forward_prefetch}"
            out[name] = _prefetched(backward_prefetch, forward_prefetch, rank, world)
    return out


def _prefetched(backward_prefetch: str | None, forward_prefetch: bool, rank: int, world: int) -> Prefetched:
    seen = Prefetched()
    model = FSDP(
        make_model(32, 5),
        auto_wrap_policy={Layer},
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
    )
    handles = model._flat_handles()
    root = handles[-1]
    phase = ["forward"]

    held: set[int] = set()
    """Non-root units whose all-gather was issued and that have not been resharded since."""

    def watch(index: int, handle: FlatParamHandle) -> None:
        start, free = handle.start_unshard, handle.free_unsharded

        def counted() -> bool:
            issued = start()
            if issued and handle is not root:
                held.add(index)
            seen.max_gathered[phase[0]] = max(seen.max_gathered.get(phase[0], 0), len(held))
            return issued

        def freed() -> None:
            free()
            held.discard(index)

        handle.start_unshard = counted  # type: ignore[method-assign]  # test-only instrumentation
        handle.free_unsharded = freed  # type: ignore[method-assign]  # test-only instrumentation

    for i, h in enumerate(handles):
        watch(i, h)
    model.register_forward_hook(lambda *_: phase.__setitem__(0, "backward"))
    ref = make_model(32, 5)
    seen.ref_diff = train_against_reference(model, ref, rank, world, steps=2)
    seen.max_gathered.clear()
    phase[0] = "forward"
    with model.watch_collectives() as issued:
        train_against_reference(model, ref, rank, world, steps=1)
    seen.backward_ops = [
        (r.op, r.phase)
        for r in issued
        if r.group is Group.SHARD and r.phase is not Phase.FORWARD and r.phase is not Phase.OTHER
    ]
    return seen


# -- collectives in the same order on every rank, whatever the timing ---------------------


class _SlowWork:
    """A collective's ``Work`` that completes late: ``is_completed`` stays False and ``wait``
    sleeps until ``delay`` seconds after issue (a slow link on this rank)."""

    def __init__(self, work: dist.Work, delay: float) -> None:
        self._work, self._ready = work, time.monotonic() + delay

    def is_completed(self) -> bool:
        return time.monotonic() >= self._ready and bool(self._work.is_completed())

    def wait(self, timeout: Any = None) -> bool:
        time.sleep(max(0.0, self._ready - time.monotonic()))
        return bool(self._work.wait())


def _delaying(fn: Callable[..., Any], delays: Iterator[float]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def slow(*args: Any, **kwargs: Any) -> Any:
        work = fn(*args, **kwargs)
        return _SlowWork(work, next(delays)) if work is not None else None

    return slow


def slow_links(rank: int) -> None:
    """Delay every asynchronous collective on this rank by a rank-dependent pseudo-random
    time, the replicate all-reduces on rank 0 most: ranks see completions at different times."""
    rng = random.Random(rank)

    def delays(scale: float) -> Iterator[float]:
        while True:
            yield rng.random() * scale

    replicate_scale = 0.03 if rank == 0 else 0.002
    dist.all_gather_into_tensor = _delaying(dist.all_gather_into_tensor, delays(0.004))
    dist.reduce_scatter_tensor = _delaying(dist.reduce_scatter_tensor, delays(0.004))
    dist.all_reduce = _delaying(dist.all_reduce, delays(replicate_scale))


@dataclass
class Ordered:
    """One rank's training under slow links: its logs and how far it is from the reference."""

    logs: dict[str, list[CollectiveRecord]] = field(default_factory=dict)
    ref_diff: dict[str, float] = field(default_factory=dict)


def collective_order(rank: int, world: int, arg: None) -> Ordered:
    """HYBRID_SHARD (2 x 2; async and sync all-reduce) and FULL_SHARD over 4 ranks, flat and
    ``use_orig_params``, with slow links: the same parameters as a single-process reference,
    and the collective logs."""
    torch.set_num_threads(1)
    slow_links(rank)
    out = Ordered()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    configs = [
        (s, orig, "async")
        for s in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.FULL_SHARD)
        for orig in (False, True)
    ] + [(ShardingStrategy.HYBRID_SHARD, orig, "sync") for orig in (False, True)]
    for strategy, orig, placement in configs:
        name = f"{strategy.name}-orig{orig}" + ("-sync" if placement == "sync" else "")
        model = FSDP(
            make_model(32, 5),
            sharding_strategy=strategy,
            auto_wrap_policy={Layer},
            use_orig_params=orig,
            device_mesh=mesh if strategy.is_hybrid else None,
            hybrid_all_reduce=placement,
        )
        ref = make_model(32, 5)
        with model.watch_collectives() as issued:
            out.ref_diff[name] = train_against_reference(model, ref, rank, world)
        out.logs[name] = issued
    return out
