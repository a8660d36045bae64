"""What the runtime promises, measured inside gloo worlds: op counts against FSDP1, gradient
lifetimes, collectives issued in the same order on every rank whatever the timing, and the
hybrid all-reduce really running while later backward compute runs."""

from __future__ import annotations

import collections
import functools
import gc
import random
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.profiler import ProfilerActivity, profile

from fsdp_core import Group, ShardingStrategy
from fsdp_shell import FSDP
from fsdp_shell.runtime.collectives import (
    all_gather_flat,
    all_reduce_flat,
    broadcast_flat,
    reduce_scatter_flat,
    use_count,
)
from fsdp_shell.runtime.log import CollectiveRecord, Phase
from fsdp_shell.runtime.protocol import Pending
from fsdp_shell.units.flat_param import FlatParamHandle


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


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 1, generator=g)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


# -- op counts ------------------------------------------------------------------------------

COUNTED = ("aten::fill_", "aten::zero_", "aten::add_", "aten::add", "aten::slice_backward", "aten::copy_")
"""Ops whose full-size calls we count: what a slice per parameter costs in backward."""


@dataclass
class OpCounts:
    """One profiled training step of one implementation on one rank."""

    names: dict[str, int] = field(default_factory=dict)
    """Every op and autograd node by name: how often it ran."""
    full_size: dict[str, int] = field(default_factory=dict)
    """``COUNTED`` ops on at least a whole unit's flat parameter's worth of elements."""


def _profile_step(model: nn.Module, full_numel: int) -> OpCounts:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(2):
        _train_step(model, opt, *_batch(step, 16))
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _train_step(model, opt, *_batch(2, 16))
    counts = OpCounts()
    names: collections.Counter[str] = collections.Counter()
    full: collections.Counter[str] = collections.Counter()
    for e in prof.events():
        names[e.name] += 1
        shapes = [s for s in e.input_shapes if s]
        if e.name in COUNTED and shapes and _numel(shapes[0]) >= full_numel:
            full[e.name] += 1
    counts.names, counts.full_size = dict(names), dict(full)
    return counts


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def op_counts(rank: int, world: int, arg: None) -> dict[str, OpCounts]:
    """One training step of ours (flat and ``use_orig_params``) and of FSDP1, profiled."""
    torch.set_num_threads(1)
    width, depth = 48, 4
    full_numel = width * width + 3 * width
    out = {}
    for orig in (False, True):
        ours = FSDP(make_model(width, depth), auto_wrap_policy={Layer}, use_orig_params=orig)
        out[f"ours-orig{orig}"] = _profile_step(ours, full_numel)
        theirs = TorchFSDP(
            make_model(width, depth),
            auto_wrap_policy=_torch_policy,
            use_orig_params=orig,
            device_id=torch.device("cpu"),
        )
        out[f"fsdp1-orig{orig}"] = _profile_step(theirs, full_numel)
    return out


def _torch_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, Layer)


# -- gradient lifetimes ---------------------------------------------------------------------


@dataclass
class Lifetimes:
    """What one rank saw of the unsharded gradients' and original parameters' lifetimes."""

    alive_at_later_hooks: list[str] = field(default_factory=list)
    """Gradients still referenced at a later hook although they should be gone: this step's
    earlier units' (sharded strategies: reduced into a new shard), and every earlier step's
    (after ``zero_grad`` and the next forward)."""
    alive_after_backward: list[str] = field(default_factory=list)
    originals_alive: int = 0
    """Original parameter objects still alive after wrapping (``use_orig_params=False``)."""
    originals_not_shard_views: int = 0
    """Original parameters (``use_orig_params=True``) whose storage is not the local shard's."""
    checked: int = 0


def _still_alive(grads: list[tuple[str, weakref.ref[torch.Tensor]]]) -> list[str]:
    """The names whose tensors outlive a short grace period: a gloo worker thread drops its
    reference to a finished collective's tensors just after ``wait()`` returns."""
    deadline = time.monotonic() + 0.5
    while True:
        alive = [n for n, r in grads if r() is not None]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.001)


def grad_lifetimes(rank: int, world: int, arg: None) -> dict[str, Lifetimes]:
    """Per strategy and ``use_orig_params``: weakrefs on every unit's autograd gradient must be
    dead once it should be released."""
    out = {}
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        for orig in (False, True):
            out[f"{strategy.name}-orig{orig}"] = _lifetimes(strategy, orig)
    return out


def _lifetimes(strategy: ShardingStrategy, orig: bool) -> Lifetimes:
    """Sharded strategies release a unit's unsharded gradient once its reduction has completed.
    NO_SHARD hands the all-reduced autograd gradient itself to the optimizer, so only
    ``zero_grad`` (and, with ``use_orig_params``, the next forward, as in FSDP1) releases it."""
    seen = Lifetimes()
    module = make_model(32, 4)
    originals = [weakref.ref(p) for p in module.parameters()]
    model = FSDP(module, sharding_strategy=strategy, auto_wrap_policy={Layer}, use_orig_params=orig)
    del module
    gc.collect()
    if orig:
        shards = {h.local.untyped_storage().data_ptr() for h in model._flat_handles()}
        seen.originals_not_shard_views = sum(
            p.untyped_storage().data_ptr() not in shards for p in model.parameters() if p.numel()
        )
    else:
        seen.originals_alive = sum(r() is not None for r in originals)
    runtime = model._tree.runtime
    earlier: list[tuple[str, weakref.ref[torch.Tensor]]] = []
    this_step: list[tuple[str, weakref.ref[torch.Tensor]]] = []

    def watch(name: str, handle: FlatParamHandle) -> None:
        take = handle.take_grad

        def take_and_check() -> torch.Tensor:
            runtime.drain()
            seen.alive_at_later_hooks.extend(_still_alive(earlier + (this_step if strategy.is_sharded else [])))
            seen.checked += 1
            g = take()
            this_step.append((name, weakref.ref(g)))
            return g

        handle.take_grad = take_and_check  # type: ignore[method-assign]  # test-only instrumentation

    for i, h in enumerate(model._flat_handles()):
        watch(f"unit{i}", h)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = _batch(step, 4)
        ((model(x) - y) ** 2).mean().backward()
        if strategy.is_sharded:
            seen.alive_after_backward.extend(_still_alive(this_step))
        opt.step()
        opt.zero_grad()
        earlier += this_step
        this_step.clear()
    return seen


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
    seen.ref_diff = _train_against_reference(model, ref, rank, world, steps=2)
    seen.max_gathered.clear()
    phase[0] = "forward"
    with model.watch_collectives() as issued:
        _train_against_reference(model, ref, rank, world, steps=1)
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
            out.ref_diff[name] = _train_against_reference(model, ref, rank, world)
        out.logs[name] = issued
    return out


def _train_against_reference(model: FSDP, ref: nn.Module, rank: int, world: int, steps: int = 3) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    worst = 0.0
    rows = 3
    for step in range(steps):
        x, y = _batch(step, rows * world)
        _train_step(model, opt, x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows])
        _train_step(ref, ropt, x, y)
        full = model.full_state_dict()
        worst = max(worst, *(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items()))
    return worst


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


def hybrid_overlap(rank: int, world: int, arg: None) -> Overlap:
    """One HYBRID_SHARD step (``world`` replicas of one rank each: on a 2-core machine more
    ranks only time-slice) of a model whose units take milliseconds of backward each."""
    torch.set_num_threads(1)
    width, depth, rows = 1024, 4, 256
    marks: list[tuple[tuple[int, str], float]] = []
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, width), *(TimedLayer(width, marks) for _ in range(depth)), nn.Linear(width, 1))
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
        _train_step(model, opt, *_batch(step, rows))
    for step in range(2, 2 + MEASURED_STEPS):
        dist.barrier()
        marks.clear()
        dist.all_reduce = timed_all_reduce
        try:
            x, y = _batch(step, rows)
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


# -- a gather's Pending needs no operands ----------------------------------------------------


@dataclass
class OperandFree:
    """All-gathers completed through ``Pending`` records that hold no tensors."""

    gathered: list[float] = field(default_factory=list)
    """A bare all-gather's result, waited through ``Pending(work)`` after ``src`` was dropped."""
    ref_diff: float = 0.0
    """Training with every unit's all-gather handed back without operands, against the reference."""
    diff_from_held: float = 0.0
    """The same training with the operands held, against the one without: the same numbers."""
    stripped: int = 0
    """How many all-gathers were handed back without operands."""


def operand_free_gathers(rank: int, world: int, arg: None) -> OperandFree:
    """The CUDA runtime's sharded all-gather once passed its waiter no operands, and the waiter
    asserted some: the first sharded gather on a GPU failed. ``Pending`` waits the same with or
    without them, on its own and inside a unit's gather."""
    seen = OperandFree()
    src = torch.full((3,), float(rank + 1))
    dst = torch.empty(3 * world)
    world_group = dist.group.WORLD
    assert isinstance(world_group, dist.ProcessGroup)
    work = all_gather_flat(dst, src, world_group, async_op=True)
    assert work is not None
    pending = Pending(work)
    del src
    pending.wait()
    seen.gathered = dst.tolist()
    stripped = FSDP(make_model(32, 4), auto_wrap_policy={Layer})
    runtime = stripped._tree.runtime
    gather = runtime.all_gather

    def without_operands(out: torch.Tensor, src: torch.Tensor) -> Pending | None:
        issued = gather(out, src)
        if issued is None:
            return None
        seen.stripped += 1
        return Pending(issued.work)

    runtime.all_gather = without_operands  # type: ignore[method-assign]  # test-only instrumentation
    seen.ref_diff = _train_against_reference(stripped, make_model(32, 4), rank, world)
    held = FSDP(make_model(32, 4), auto_wrap_policy={Layer})
    _train_against_reference(held, make_model(32, 4), rank, world)
    mine, theirs = stripped.full_state_dict(), held.full_state_dict()
    seen.diff_from_held = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
    return seen


RELEASE_CALLS = 200
"""Calls of each synchronous collective ``released_operands`` makes."""


def released_operands(rank: int, world: int, arg: None) -> dict[str, int]:
    """In how many of ``RELEASE_CALLS`` calls of each synchronous collective gloo's threads still
    held one of its tensors when the call returned: torch's own calls (the probe's baseline) and
    the library's, which wait until they have let go (``fsdp_shell.runtime.collectives``)."""
    group = dist.group.WORLD
    assert group is not None
    src, out = torch.randn(1000), torch.empty(1000 * world)

    def held_after(call: Callable[[], object], *tensors: torch.Tensor) -> int:
        held = 0
        for _ in range(RELEASE_CALLS):
            before = [use_count(t) for t in tensors]
            call()
            held += any(use_count(t) > n for t, n in zip(tensors, before))
        return held

    return {
        "torch all_gather_into_tensor": held_after(lambda: dist.all_gather_into_tensor(out, src), src, out),
        "torch all_reduce": held_after(lambda: dist.all_reduce(src), src),
        "all_gather_flat": held_after(lambda: all_gather_flat(out, src, group), src, out),
        "reduce_scatter_flat": held_after(lambda: reduce_scatter_flat(src, out, group), src, out),
        "all_reduce_flat": held_after(lambda: all_reduce_flat(src, group), src),
        "broadcast_flat": held_after(lambda: broadcast_flat(src, 0), src),
    }
