"""What the memory tests run on each rank: training steps measured by ``LiveBytes``, with and
without slow links, against FSDP1's, and the reference cycles a step leaves for the garbage
collector."""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_core import PLANS_IN_FLIGHT, CPUOffload, Event, HookEvent, MixedPrecision, Plan, ShardingStrategy
from fsdp_core.execution import LaneOrder
from fsdp_core.memory import Executor, GatherBytes, backward_footprints, gather_bytes, unshard_footprints
from fsdp_shell import FSDP
from fsdp_shell.memory import LiveBytes
from fsdp_shell.memory.measure import train_measured
from fsdp_shell.memory.workload import Config, hf_model
from fsdp_shell.runtime.cpu import CpuRuntime
from fsdp_shell.runtime.interpreter import PlanRun
from fsdp_shell.units.unshard import UnshardRunner
from tests.worlds.runtime_order_cases import slow_links

WIDTH = 64
UNITS = 6
STEPS = 3


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.lin(x)) + x
        return out


@dataclass(frozen=True)
class MemoryCase:
    strategy: ShardingStrategy
    use_orig_params: bool = False
    bf16: bool = False
    accumulate: int = 1
    """Backwards per step; all but the last inside ``no_sync()``."""
    model: str = "mlp"
    """``"mlp"`` (``UNITS`` residual layers) or a tiny Hugging Face ``"gpt2"``/``"llama"``."""
    offload: bool = False
    hybrid_all_reduce: str = "async"


def _model(case: MemoryCase) -> tuple[nn.Module, type[nn.Module]]:
    if case.model == "mlp":
        torch.manual_seed(0)
        return nn.Sequential(*(Layer() for _ in range(UNITS))), Layer
    return hf_model(case.model)


def _loss(model: nn.Module, case: MemoryCase, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    if case.model == "mlp":
        out: torch.Tensor = model(torch.randn(8, WIDTH, generator=gen)).float().square().mean()
        return out
    ids = torch.randint(0, 64, (2, 16), generator=gen)
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    return loss


@dataclass
class Measured:
    peaks: dict[str, int]
    """The peak of each phase of each step (``"step 1: backward"``), in bytes."""
    most_plans_in_flight: int
    plans: list[tuple[str, int, int, int, int]]
    """Every post-backward plan's hook ops as run: the plan's kind, and measured against
    ``backward_footprints``' prediction the peak (measured, predicted) and the bytes at the end
    (measured, predicted), each relative to the hook's start."""
    gathers: list[tuple[str, int, int, int, int]]
    """The same for every hook's all-gather actions, against ``unshard_footprints``."""


@contextlib.contextmanager
def measuring_plans(live: LiveBytes, runtime: CpuRuntime, into: list[tuple[str, int, int, int, int]]) -> Iterator[None]:
    """For the block: each plan's hook ops measured in a ``live`` window; at the end, beside
    ``backward_footprints`` of the plans of each backward (one per phase of ``live``)."""
    run_hook_ops = PlanRun.run_hook_ops
    runs: dict[str, list[tuple[Plan, int, int]]] = {}

    def measured(run: PlanRun) -> None:
        with live.window() as w:
            run_hook_ops(run)
        runs.setdefault(live.current_phase, []).append((run.plan, w.peak - w.start, w.end - w.start))

    PlanRun.run_hook_ops = measured  # type: ignore[method-assign,assignment]  # test-only instrumentation, undone below
    try:
        yield
    finally:
        PlanRun.run_hook_ops = run_hook_ops  # type: ignore[method-assign]  # the original
    for backward in runs.values():
        predicted = backward_footprints(
            [plan for plan, _, _ in backward], Executor.CPU_LANE, lane_issues_shard=runtime.lane_issues_shard
        )
        for (plan, peak, net), want in zip(backward, predicted, strict=True):
            flags = plan.request.flags
            into.append((f"sync={flags.sync_gradients} accumulate={flags.accumulate}", peak, want.peak, net, want.net))


def against_fsdp1(
    rank: int, world: int, job: tuple[Config, int]
) -> tuple[dict[str, dict[str, int]], list[tuple[str, int, int, int, int]]]:
    """``job``'s configuration trained ``steps`` steps with ours, then with FSDP1, each measured
    by ``train_measured``; and ours' post-backward plans measured against their prediction, as
    ``measuring_plans`` measures them."""
    cfg, steps = job
    plans: list[tuple[str, int, int, int, int]] = []

    def measuring(live: LiveBytes, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        assert isinstance(model, FSDP) and isinstance(model._tree.runtime, CpuRuntime)
        return measuring_plans(live, model._tree.runtime, plans)

    ours = train_measured(cfg, "ours", rank=rank, steps=steps, around=measuring)
    fsdp1 = train_measured(cfg, "fsdp1", rank=rank, steps=steps)
    return {"ours": ours, "fsdp1": fsdp1}, plans


@contextlib.contextmanager
def _counting_plans_in_flight(order: LaneOrder[torch.Tensor], into: list[int]) -> Iterator[None]:
    """For the block: at each plan ``order`` begins, how many of the ``PLANS_IN_FLIGHT`` latest
    plans (this one included) began with lane work before them the host had not waited for, as
    ``LaneOrder.begin_plan`` finds it (the bound's witness, kept here rather than on the order)."""
    begin_plan = LaneOrder.begin_plan
    marks: list[int] = []

    def counted(self: LaneOrder[torch.Tensor]) -> int:
        if self is order:
            marks.append(self.submitted)
            into.append(sum(1 for m in marks[-PLANS_IN_FLIGHT:] if m > self.waited))
        return begin_plan(self)

    LaneOrder.begin_plan = counted  # type: ignore[method-assign,assignment]  # test-only instrumentation, undone below
    try:
        yield
    finally:
        LaneOrder.begin_plan = begin_plan  # type: ignore[method-assign]  # the original


@contextlib.contextmanager
def _measuring_gathers(live: LiveBytes, model: FSDP, into: list[tuple[str, int, int, int, int]]) -> Iterator[None]:
    """For the block: each hook's all-gather actions (``UnshardRunner.run``) measured in a
    ``live`` window; at the end, those of the iterations that ran the planned schedule beside
    ``unshard_footprints`` of one iteration (the same in every such iteration)."""
    tree = model._tree
    runner = tree.unshard
    run = UnshardRunner.run
    runs: list[list[tuple[HookEvent, int, int]]] = []

    def measured(self: UnshardRunner, event: Event, unit: int) -> None:
        planned = self is runner and not self._recording
        with live.window() as w:
            run(self, event, unit)
        if planned:
            backward = (Event.PRE_BACKWARD, Event.POST_BACKWARD)
            if not runs or (event not in backward and runs[-1] and runs[-1][-1][0].event in backward):
                runs.append([])
            runs[-1].append((HookEvent(event, unit), w.peak - w.start, w.end - w.start))

    UnshardRunner.run = measured  # type: ignore[method-assign]  # test-only instrumentation, undone below
    try:
        yield
    finally:
        UnshardRunner.run = run  # type: ignore[method-assign]  # the original
    units = [GatherBytes(0) if h is None else gather_bytes(h.request) for h in tree.handles]
    reshard = [h is not None and h.request.should_free_in_backward for h in tree.handles]
    predicted = {f.event: f for f in unshard_footprints(runner.schedule, units, reshard)}
    for iteration in runs:
        for event, peak, net in iteration:
            want = predicted[event]
            into.append((f"{event.event.value} {event.unit}", peak, want.peak, net, want.net))


@contextlib.contextmanager
def _slowed(rank: int) -> Iterator[None]:
    """``slow_links`` for the block: every collective completes late by a rank-dependent time."""
    saved = (dist.all_gather_into_tensor, dist.reduce_scatter_tensor, dist.all_reduce)
    slow_links(rank)
    try:
        yield
    finally:
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor, dist.all_reduce = saved


def _fsdp(case: MemoryCase, world: int) -> FSDP:
    """``case``'s model, wrapped (a hybrid strategy: two replicas of ``world // 2`` ranks)."""
    hybrid = case.strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hybrid else None
    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case.bf16 else None
    net, block = _model(case)
    return FSDP(
        net,
        auto_wrap_policy={block},
        sharding_strategy=case.strategy,
        mixed_precision=precision,
        use_orig_params=case.use_orig_params,
        device_mesh=mesh,
        cpu_offload=CPUOffload(offload_params=case.offload),
        hybrid_all_reduce=case.hybrid_all_reduce,
    )


def _train(rank: int, world: int, case: MemoryCase) -> Measured:
    gc.collect()
    with LiveBytes() as live:
        model = _fsdp(case, world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runtime = model._tree.runtime
        assert isinstance(runtime, CpuRuntime)
        plans: list[tuple[str, int, int, int, int]] = []
        gathers: list[tuple[str, int, int, int, int]] = []
        in_flight: list[int] = []
        with (
            measuring_plans(live, runtime, plans),
            _measuring_gathers(live, model, gathers),
            _counting_plans_in_flight(runtime.order, in_flight),
        ):
            _steps(model, opt, live, case, rank)
        peaks = {k: v for k, v in live.peaks.items() if k != "other"}
        measured = Measured(peaks, max(in_flight, default=0), plans, gathers)
        del model, opt
    return measured


def _steps(model: FSDP, opt: torch.optim.Optimizer, live: LiveBytes, case: MemoryCase, rank: int) -> None:
    """``STEPS`` optimizer steps, each phase of each in a phase of ``live`` of its own."""
    for step in range(STEPS):
        for micro in range(case.accumulate):
            sync = micro == case.accumulate - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                with live.phase(f"step {step}: forward {micro}"):
                    loss = _loss(model, case, rank)
                with live.phase(f"step {step}: backward {micro}"):
                    torch.autograd.backward(loss)
                del loss
        with live.phase(f"step {step}: optimizer"):
            opt.step()
            opt.zero_grad()


def timing_independent(rank: int, world: int, case: MemoryCase) -> tuple[Measured, Measured]:
    """The same training measured twice: as it runs, and with every collective completing late."""
    plain = _train(rank, world, case)
    with _slowed(rank):
        slowed = _train(rank, world, case)
    return plain, slowed


def tensors_in_cycles(rank: int, world: int, case: MemoryCase) -> list[str]:
    """Tensors that a training step leaves unreachable except through reference cycles (freed
    only by the garbage collector), described: none expected."""
    model = _fsdp(case, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    found: list[str] = []
    gc.collect()
    gc.disable()
    try:
        for step in range(STEPS):
            gc.set_debug(gc.DEBUG_SAVEALL)
            torch.autograd.backward(_loss(model, case, rank))
            opt.step()
            opt.zero_grad()
            gc.collect()
            found += [f"step {step}: {tuple(o.shape)} {o.dtype}" for o in gc.garbage if isinstance(o, torch.Tensor)]
            gc.set_debug(0)
            gc.garbage.clear()
    finally:
        gc.set_debug(0)
        gc.enable()
    return found


def outliving_their_model(rank: int, world: int, case: MemoryCase) -> tuple[list[str], list[str]]:
    """What of a model is still alive once it and its optimizer are deleted after ``STEPS``
    steps (its flat parameters, its modules' parameters, the wrapper, the wrapped module):
    without a garbage collection, and after one. Nothing is expected in either.

    Without: after a collection has freed what the steps left in cycles (``tensors_in_cycles``'
    concern: under coverage.py, the CI's, a 4-rank hybrid world with offload left garbage that
    held its last flat parameter), the collector off, for up to ``RELEASE_SECONDS``, since
    another thread may hold a tensor for a moment (gloo's threads hold a collective's tensors
    briefly after its ``wait()`` returns): what only a reference cycle through the model holds
    stays alive however long."""
    model = _fsdp(case, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _steps(model, opt, LiveBytes(), case, rank)
    held: list[tuple[str, weakref.ref[object]]] = [
        ("the wrapper", weakref.ref(model)),
        ("the wrapped module", weakref.ref(model.module)),
    ]
    held += [(f"flat parameter {i}", weakref.ref(h.flat_param)) for i, h in enumerate(model._flat_handles())]
    held += [(name, weakref.ref(p)) for name, p in model.named_parameters()]
    gc.collect()
    gc.disable()
    try:
        del model, opt
        deadline = time.monotonic() + RELEASE_SECONDS
        while any(ref() is not None for _, ref in held) and time.monotonic() < deadline:
            time.sleep(0.001)
        without_gc = [name for name, ref in held if ref() is not None]
    finally:
        gc.enable()
    gc.collect()
    return without_gc, [name for name, ref in held if ref() is not None]


RELEASE_SECONDS = 2.0


HEAP_STEPS = 300
"""Steps between the two counts of ``tracked_objects``."""


def tracked_objects(rank: int, world: int, arg: None) -> tuple[int, int]:
    """How many Python objects the garbage collector tracks (after ``gc.collect()``) 20 steps
    into training a two-unit model, and ``HEAP_STEPS`` steps later. Whatever the library kept per
    step (a record, an event, a tensor) would be among them; torch's own per-step objects are
    not, and neither are this machine's timings, so the count is exact."""
    model = FSDP(nn.Sequential(nn.Linear(10, 9), nn.Linear(9, 9)), auto_wrap_policy={nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def steps(n: int) -> int:
        for _ in range(n):
            model(torch.randn(4, 10)).sum().backward()
            opt.step()
            opt.zero_grad()
        gc.collect()
        return len(gc.get_objects())

    return steps(20), steps(HEAP_STEPS)
