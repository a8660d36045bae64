"""Step time, predicted then measured: gloo on loopback, the CPU runtime, per configuration.

Run on demand: ``python benchmarks/bench_step_time.py [--configs NAME,...] [--steps 20]``
(the configurations of ``benchmarks/bench_predict.py``).

The prediction is ``fsdp_core.sim.simulate_iteration`` of the model's real units
(``model_of_units``: their plans, the recorded all-gather orders, ``Executor.CPU_LANE``: where
the CPU runtime runs each op), plus the optimizer step. Its inputs are measured in the world
that then trains, in turns with its training steps (``measure``: five rounds, each timing the
inputs and then a fifth of the steps, so that a slow phase of the machine falls on both), none
on the configuration it predicts:

- **compute**: each unit's forward and backward, the step run for real on every rank of the
  world at once (as they will train, sharing the machine), with FSDP's parameter views but none
  of its hooks' work (``time_trace``); the slowest rank's;
- **collectives**: every size the units' plans and all-gathers use, with the runtime's own gloo
  collectives, each issued after every rank computed for as long as a unit's backward (as the
  step meets it) and timed to its end; the *mean* of 30 calls (``Beside.collective_after_compute``:
  the latency here has a fast and a slow mode, and the median is the fast one), the rank's that
  waited least (``in_step``); ``fit_table`` fits them (``CostModel.measured``). The event check
  that ends each backward (``IterationModel.event_check``) is timed so too, and priced as timed;
- **how collectives and compute share a rank's core** (``sharing_one_core``): each size also
  timed while every rank computes, and compute timed while collectives of that size are in
  flight, in the same world: ``LinkModel.compute_slowdown`` per kind of collective (measured
  up to 16x: gloo's threads wait for the core the rank computes on) and
  ``LinkModel.transfers_slow_compute`` (1.0-2.3x); gloo runs a group's collectives side by side
  (``one_collective_per_group=False``);
- **FSDP's host work per unit** (hooks, the plan interpreter, casts): calibrated on a world of
  one rank training the same model: what its measured iteration takes beyond its simulated one
  without host work, shared equally by the units, half in forward, half in backward;
- **the optimizer step**: ``step()`` and ``zero_grad()`` on tensors of the shapes each rank's
  optimizer steps (``optimized_tensors``), every rank at once;
- **each collective's processor work**: the processor time gloo's threads spend on one call
  (``Beside.processor_ms``, from ``/proc/self/task/*/schedstat``).

Each world is simulated by two models of how a rank's collectives share its core, printed side
by side and summarized apart. The first takes the slowdowns measured above
(``sharing_one_core``). The second, the core's (``core_model``), slows nothing in the simulation
and instead charges the core: the host work calibrated on one rank is stretched by the ranks
``pin`` puts on one core (they take turns on it), and the collectives' processor work, of every
rank on the core, is added where it falls beside compute
(``IterationTimeline.work_beside_compute_ms``).

What a collective costs *inside* a step beyond that (the host issuing it and handing it to
gloo's threads, what the plan interpreter does around it) is not measured apart: it is the
prediction's two free parameters, ``InStep``'s ms per all-gather and ms per reduction,
fitted (least squares, >= 0) on the other configurations' rows, never on the row predicted.

Measured: the median over ``--steps`` steps (after warm-up) of each rank's forward + backward
(the synchronising one, after ``no_sync()`` ones when the configuration accumulates) and
optimizer time, the worst rank. Each rank's host thread runs on one core of its own (``pin``;
``--pin all`` puts all of the rank's threads there, ``--pin none`` leaves them to the
scheduler), while timing the inputs as while training. Printed per
world as it runs: the simulated and measured ms, and where the time goes (the host thread's time
blocked in collectives' ``wait`` against the simulated iteration's time not computing, the rest
against the simulated compute and host work; where the rank's core went, ``Core``); at the end,
predicted / measured per configuration (simulated + ``InStep``) and how many are within 10%.
With ``--repeat N`` each configuration's world is started N times in the same run, each
simulated from its own inputs and measured: the spread of the measured times is how closely
this machine can check any prediction. The summary then counts the rows within 10% of their
configuration's mean over its worlds (``own_mean_within``), and compares each configuration's
mean prediction over its worlds with their mean measured time (what a prediction made before
launch can promise where one world's step differs from the next's)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import itertools
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
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
    Activity,
    Collective,
    CollectiveSample,
    CostModel,
    Interval,
    IterationTimeline,
    Link,
    LinkModel,
    Load,
    SlowdownSample,
    compute_slowdown_of,
    event_check_volume,
    fit_table,
    model_of_units,
    simulate_iteration,
    slowdown,
)
from fsdp_shell import FSDP
from fsdp_shell.predict import Prediction
from fsdp_shell.predict.trace import TraceUnit, time_trace
from fsdp_shell.runtime.collectives import all_gather_flat
from fsdp_shell.runtime.cpu import gloo_reduce_scatter
from fsdp_shell.runtime.protocol import Pending
from fsdp_shell.units.build import find_units, param_names, unit_params
from tests.worlds.dist_harness import run_world

Size = tuple[Collective, Group, int, torch.dtype]
"""A collective, its group, the numel FSDP passes (all-gather: its output) and the dtype."""


def unit_collectives(p: Prediction) -> dict[tuple[int, Activity], Size]:
    """Every collective of one synchronising iteration, by the unit and activity the simulated
    iteration gives it: the units' all-gathers (forward and backward) and their plans'
    reductions, and the event check that ends each backward under unit -1
    (``event_check_volume``; an int64 all-gather, which ``_issuer`` runs on the wrapper's control
    group, as the check does)."""
    out: dict[tuple[int, Activity], Size] = {}
    for unit, u in enumerate(p.units):
        if u is None:
            continue
        check = event_check_volume(u.request.sharding)
        if check.group_size > 1:
            out[(-1, Activity.EVENT_CHECK)] = (Collective.ALL_GATHER, Group.SHARD, check.output_numel, check.dtype)
        gather = all_gather_volume(u.request)
        if gather is not None:
            size = (Collective.ALL_GATHER, Group.SHARD, gather.output_numel, gather.dtype)
            out[(unit, Activity.FORWARD_ALL_GATHER)] = out[(unit, Activity.BACKWARD_ALL_GATHER)] = size
        for v in comm_volume(build_plan(u.request)):
            collective = Collective(v.collective)
            activity = Activity.REDUCE_SCATTER if collective is Collective.REDUCE_SCATTER else Activity.ALL_REDUCE
            out[(unit, activity)] = (collective, v.group, v.input_numel, v.dtype)
    return out


def sizes(p: Prediction) -> list[Size]:
    """Every size ``unit_collectives`` holds, each once, in the order first met."""
    return list(dict.fromkeys(unit_collectives(p).values()))


def _calls(call: Callable[[], float], repeats: int) -> list[float]:
    """What ``call()`` returns (ms) on ``repeats`` calls, every rank starting each together, after
    as many untimed calls (a group's first collectives after the world starts are slow and speed
    up over several calls; in training they have had the warm-up steps)."""
    out = []
    for i in range(2 * repeats):
        dist.barrier()
        ms = call()
        if i >= repeats:
            out.append(ms)
    return out


def _ms(run: Callable[[], object]) -> float:
    """How long ``run()`` takes (ms)."""
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def _time(run: Callable[[], object], repeats: int) -> float:
    """The median ms of ``run()`` (``_calls``)."""
    return statistics.median(_calls(lambda: _ms(run), repeats))


def _issuer(model: torch.nn.Module, size: Size) -> Callable[[], Pending]:
    """A function that issues ``size``'s collective as the runtime does, returning it in flight."""
    collective, group, numel, dtype = size
    assert isinstance(model, FSDP)
    groups = model._tree.groups
    pg = groups.of(group)
    n = pg.size()
    if collective is Collective.ALL_GATHER and dtype is torch.int64:
        control = model._tree.control
        gathered, one = torch.zeros(numel, dtype=dtype), torch.zeros(1, dtype=dtype)
        return lambda: Pending(_work(all_gather_flat(gathered, one, control, async_op=True)))
    if collective is Collective.ALL_GATHER:
        out = torch.zeros(numel, dtype=dtype)
        mine = out.narrow(0, 0, numel // n).clone()
        return lambda: Pending(_work(all_gather_flat(out, mine, groups.gather_group, async_op=True)))
    if collective is Collective.REDUCE_SCATTER:
        src = torch.zeros(numel, dtype=dtype)
        dst = torch.zeros(numel // n, dtype=dtype)
        chunks = torch.empty_like(src)
        return lambda: gloo_reduce_scatter(dst, src, pg, chunks)
    tensor = torch.zeros(numel, dtype=dtype)
    return lambda: Pending(_work(dist.all_reduce(tensor, group=pg, async_op=True)))


def _work(work: object) -> dist.Work:
    assert isinstance(work, dist.Work)
    return work


_BLOCK = torch.randn(64, 64)


def _compute_chunk() -> None:
    """A small piece of compute on the host thread (about an autograd op's)."""
    torch.tanh(_BLOCK @ _BLOCK)


@dataclasses.dataclass(frozen=True)
class Beside:
    """One collective size timed alone, after compute and while every rank computes, and a fixed
    amount of compute timed alone and while collectives of that size are in flight (ms,
    medians)."""

    collective_alone: float
    """Issued and waited for right after a barrier."""
    collective_after_compute: float
    """Issued and waited for after every rank computed for as long as a unit's backward, as a
    step meets it; the *mean*, where the other fields are medians. This machine's collective
    latency has two modes, phases of some calls each: in a world of two ranks, a 16 KB
    all-reduce took 0.35-0.62 ms or 1.9-3.6 ms after compute (medians of 6 calls), an 8-byte
    all-gather 0.33-0.61 or 1.4-2.8 ms right after a barrier. The median of the calls is the
    fast mode; a step, the sum of many collectives, takes about the sum of their means. It is
    the time that the prediction prices."""
    collective_loaded: float
    compute_alone: float
    compute_loaded: float
    processor_ms: float
    """The processor time gloo's threads spend on one call (``gloo_cpu_ms``), calls issued back
    to back: the collective's work on the rank's core."""

    @staticmethod
    def each(of: Callable[[list[float]], float], column: Iterable[Beside]) -> Beside:
        """``of`` (e.g. ``max``, ``statistics.median``) of each field over ``column``."""
        column = list(column)
        return Beside(*(of([getattr(b, f.name) for b in column]) for f in dataclasses.fields(Beside)))

    @staticmethod
    def over_rounds(rounds: Iterable[Beside]) -> Beside:
        """One size's rounds taken together: the mean of ``collective_after_compute`` (each
        round's is a mean of as many calls), the median of the other fields."""
        rounds = list(rounds)
        median = Beside.each(statistics.median, rounds)
        return dataclasses.replace(
            median, collective_after_compute=statistics.fmean(b.collective_after_compute for b in rounds)
        )


def _beside(issue: Callable[[], Pending], repeats: int, lead_in_ms: float, chunks: int = 40) -> Beside:
    """``Beside`` of the collective ``issue`` starts: it alone, after ``lead_in_ms`` of compute
    on every rank, beside compute (every rank computing in small chunks until its own copy
    completes), and ``chunks`` of compute beside enough of it in flight to outlast them (how
    many: agreed by every rank, so each issues as many)."""

    def after_compute() -> float:
        end = time.perf_counter() + lead_in_ms / 1e3
        while time.perf_counter() < end:
            _compute_chunk()
        return _ms(lambda: issue().wait())

    def loaded() -> None:
        pending = issue()
        while not _work(pending.work).is_completed():
            _compute_chunk()
        pending.wait()

    def compute() -> None:
        for _ in range(chunks):
            _compute_chunk()

    alone = _time(lambda: issue().wait(), repeats)
    after = statistics.fmean(_calls(after_compute, repeats))
    collective_loaded = _time(loaded, repeats)
    compute_alone = _time(compute, repeats)
    count = torch.tensor([math.ceil(3 * compute_alone / max(alone, 1e-3))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    in_flight = int(count)

    def compute_beside_in_flight() -> float:
        pending = [issue() for _ in range(in_flight)]
        ms = _ms(compute)
        for p in pending:
            p.wait()
        return ms

    compute_loaded = statistics.median(_calls(compute_beside_in_flight, repeats))

    def processor() -> float:
        before = gloo_cpu_ms()
        for _ in range(repeats):
            issue().wait()
        return (gloo_cpu_ms() - before) / repeats

    processor_ms = statistics.median(_calls(processor, 3))
    return Beside(alone, after, collective_loaded, compute_alone, compute_loaded, processor_ms)


@contextlib.contextmanager
def host_waits(seconds: list[float]) -> Iterator[None]:
    """Add to ``seconds[0]`` the time the main thread spends in ``Pending.wait`` inside."""
    wait: Callable[[Pending], None] = Pending.wait
    main = threading.main_thread()

    def timed(self: Pending) -> None:
        if threading.current_thread() is not main:
            return wait(self)
        start = time.perf_counter()
        try:
            return wait(self)
        finally:
            seconds[0] += time.perf_counter() - start

    Pending.wait = timed  # type: ignore[method-assign]  # a benchmark's probe, restored below
    try:
        yield
    finally:
        Pending.wait = wait  # type: ignore[method-assign,assignment]  # restoring the original


@dataclasses.dataclass
class Measured:
    compute: list[tuple[float, float]]
    """Each unit's forward and backward ms, the step run here for real (``local_compute``),
    every rank at once."""
    optimizer_alone_ms: float
    """``optimizer_ms``, every rank at once."""
    collectives: list[Beside]
    """Per ``sizes`` entry: it alone and beside compute (``Beside``)."""
    forward_backward_ms: float
    optimizer_ms: float
    waits_ms: float
    """Of ``forward_backward_ms``'s step, the host thread's time in collectives' ``wait``."""
    core: Core
    """Where the rank's core went over the timed steps."""


@dataclasses.dataclass(frozen=True)
class Core:
    """A rank's timed steps, per step (ms, means, barriers included): their wall time and the
    processor time of its threads (``thread_cpu_ms``), the host thread's, gloo's (its TCP loops
    and run loops) and the rest (the runtime's lane, the store); what is left of the wall time
    its threads did not run (its core idle, or running another rank pinned to it)."""

    wall: float
    host: float
    gloo: float
    other: float

    def __str__(self) -> str:
        idle = self.wall - self.host - self.gloo - self.other
        return (
            f"core per step: {self.wall:.2f} = host thread {self.host:.2f} + gloo's threads {self.gloo:.2f} + "
            f"others {self.other:.2f} + not running {idle:.2f}"
        )


def thread_cpu_ms() -> dict[int, tuple[str, float]]:
    """Each of this process's threads: its name and the processor time it has run (ms, from
    ``/proc/self/task/*/schedstat``; Linux only, else nothing)."""
    out = {}
    tasks = Path("/proc/self/task")
    for task in tasks.iterdir() if tasks.is_dir() else ():
        with contextlib.suppress(OSError, ValueError, IndexError):
            out[int(task.name)] = (
                (task / "comm").read_text().strip(),
                int((task / "schedstat").read_text().split()[0]) / 1e6,
            )
    return out


def gloo_cpu_ms() -> float:
    """The processor time this process's gloo threads (TCP loops, run loops) have run (ms)."""
    return sum(ms for name, ms in thread_cpu_ms().values() if name.startswith(GLOO_THREADS))


GLOO_THREADS = ("gloo", "pt_gloo")
"""The names gloo's threads start with."""


def core_use(before: dict[int, tuple[str, float]], wall_ms: float, steps: int) -> Core:
    """``Core`` of ``steps`` steps that took ``wall_ms`` since ``before`` (``thread_cpu_ms``)."""
    host, gloo, other = 0.0, 0.0, 0.0
    for tid, (name, ms) in thread_cpu_ms().items():
        ran = ms - before.get(tid, (name, 0.0))[1]
        if tid == threading.main_thread().native_id:
            host += ran
        elif name.startswith(GLOO_THREADS):
            gloo += ran
        else:
            other += ran
    return Core(wall_ms / steps, host / steps, gloo / steps, other / steps)


class Pinning(enum.Enum):
    """Which of a rank's threads ``pin`` keeps on the rank's core."""

    NONE = "none"
    """None: the scheduler places every thread. One configuration's median step then differed up
    to 1.8x between worlds started one after the other (runs 1-2 of the user guide's table)."""
    HOST = "host"
    """The host thread, and the threads it starts later (the gloo threads of the process groups
    FSDP creates, the CPU runtime's lane). The default process group's gloo threads (its TCP
    loop and two run loops), started before the job, stay free to run on any core: the
    benchmark's runs 2-12."""
    ALL = "all"
    """Every thread of the rank, those of the default process group too: a rank's collectives
    then run on its own core only. Measured in run 13: the measured step more repeatable (a
    configuration's worlds differed up to 1.39x, against 1.43-1.65x with ``HOST``), the
    simulated one less (the slowdown of a collective beside compute on the same core, timed
    apart, varied between worlds of one configuration: an all-gather's 1.15x, 2.51x and 4.03x
    in ``mlp-full_shard-bf16``'s)."""


def cores_of(rank: int, world: int, cores: list[int]) -> set[int]:
    """The cores ``rank`` of ``world`` keeps its threads on (``pin``): as many of ``cores`` as
    each rank can have to itself, else one, ``rank`` modulo the cores (as a rank owns its GPU)."""
    share = len(cores) // world
    return set(cores[rank * share : (rank + 1) * share]) if share else {cores[rank % len(cores)]}


def pin(rank: int, world: int, pinning: Pinning) -> None:
    """Keep ``pinning``'s threads of this rank on its cores (``cores_of``: one on this machine of
    two cores; on one with at least two per rank, gloo's threads get a core besides the one
    computing). An affinity set with ``pid`` 0 is the calling thread's alone, and threads
    started later inherit it; the threads already running are pinned one by one (``ALL``)."""
    if pinning is Pinning.NONE:
        return
    mine = cores_of(rank, world, sorted(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, mine)
    if pinning is Pinning.ALL:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), mine)


def measure(rank: int, world: int, job: tuple[Config, list[Size], int, int, Pinning]) -> Measured:
    """The inputs and the training they predict, timed in turns (``ROUNDS`` rounds, after
    ``warmup`` training steps): each round times the compute and the optimizer step without FSDP
    (every rank at once, as they train), each collective alone and beside compute (``_beside``),
    then a share of the ``steps`` training steps. Each input is the median of its rounds, the
    training step the median of all timed steps. This machine has slow phases: an all-reduce of
    16 KB took a median 3 ms over 20 calls, then 0.5 ms in the next 20, on both ranks; timed in
    turns, such a phase falls on the inputs and on the steps alike, not on one of them only.
    The rank's threads kept on its core as ``pinning`` says (``pin``)."""
    cfg, wanted, steps, warmup, pinning = job
    pin(rank, world, pinning)
    p = predict(cfg)
    dist.barrier()
    model = _wrap("ours", cfg)
    opt = optimizer_of(cfg, model.parameters())
    issuers = [_issuer(model, s) for s in wanted]
    forward_backward: list[float] = []
    optimizer: list[float] = []
    waits: list[float] = []
    numbering = itertools.count()

    def train(count: int, timed: bool) -> None:
        for _ in range(count):
            step = next(numbering)
            for micro in range(cfg.accumulate):
                sync = micro == cfg.accumulate - 1
                dist.barrier()
                waited = [0.0]
                start = time.perf_counter()
                with host_waits(waited), contextlib.nullcontext() if sync else model.no_sync():  # type: ignore[operator]  # our wrapper
                    loss = loss_of(model, cfg, rank, step)
                    torch.autograd.backward(loss)
                if timed and sync:
                    forward_backward.append((time.perf_counter() - start) * 1e3)
                    waits.append(waited[0] * 1e3)
            start = time.perf_counter()
            opt.step()
            opt.zero_grad()
            if timed:
                optimizer.append((time.perf_counter() - start) * 1e3)

    train(warmup, timed=False)
    computes, optimizers, passes, cores = [], [], [], []
    for r in range(ROUNDS):
        computes.append(local_compute(cfg, p, repeats=3))
        optimizers.append(optimizer_ms(cfg, p, repeats=3))
        lead_in = statistics.median(b for _, b in computes[-1])
        passes.append([_beside(issue, 6, lead_in) for issue in issuers])
        share = steps // ROUNDS + (r < steps % ROUNDS)
        train(1, timed=False)
        cpu_before, wall_before = thread_cpu_ms(), time.perf_counter()
        train(share, timed=True)
        cores.append(core_use(cpu_before, (time.perf_counter() - wall_before) * 1e3, 1))
    total = Core(*(sum(getattr(c, f.name) for c in cores) / steps for f in dataclasses.fields(Core)))
    return Measured(
        [(statistics.median(f for f, _ in unit), statistics.median(b for _, b in unit)) for unit in zip(*computes)],
        statistics.median(optimizers),
        [Beside.over_rounds(column) for column in zip(*passes)],
        statistics.median(forward_backward),
        statistics.median(optimizer),
        statistics.median(waits),
        total,
    )


ROUNDS = 5
"""The rounds ``measure`` times a world's inputs and its training steps in, in turns."""


def local_compute(cfg: Config, p: Prediction, repeats: int = 9) -> list[tuple[float, float]]:
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
        module, units, lambda m: loss_of(m, cfg, 0, 0), mixed_precision=p.options.mixed_precision, repeats=repeats
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


HOST_WORK = (Activity.FORWARD, Activity.BACKWARD, Activity.ELEMENTWISE)
"""The simulated activities that are computing, not communicating (the element-wise ops the CPU
runtime runs on its lane thread among them)."""


GLOO = LinkModel(one_collective_per_group=False)
"""gloo runs a group's asynchronous collectives side by side; nothing else slows anything."""


def simulate(
    p: Prediction,
    compute: list[tuple[float, float]],
    table: object,
    world: int,
    links: LinkModel = GLOO,
    check_ms: float | None = None,
) -> IterationTimeline:
    """The simulated iteration of ``p``'s units on the CPU runtime (``Executor.CPU_LANE``): the
    synchronising one, after one inside ``no_sync()`` when ``p`` accumulates (as measured),
    ending with the event check, costing ``check_ms`` when given."""
    assert isinstance(table, tuple)
    model = model_of_units(
        p.units,
        p.trace,
        root=len(p.units) - 1,
        compute_ms=compute,
        cost=CostModel(measured=table),
        ranks_per_node=world,
        backward_prefetch=p.options.backward_prefetch,
        forward_prefetch=p.options.forward_prefetch,
        executor=Executor.CPU_LANE,
        follows_no_sync=p.accumulate > 1,
        event_check_ms=check_ms,
    )
    return simulate_iteration(model, links)


def working_ms(timeline: IterationTimeline) -> float:
    """Of the simulated iteration, the ms spent computing (``HOST_WORK``): nearly all of it on
    the host thread, the counterpart of a step's time outside collectives' ``wait``."""
    return sum(i.duration_ms for i in timeline.intervals if i.activity in HOST_WORK)


def collective_counts(timeline: IterationTimeline) -> tuple[int, int]:
    """The iteration's all-gathers and its reductions (reduce-scatters, all-reduces)."""
    gathers = sum(i.activity in (Activity.FORWARD_ALL_GATHER, Activity.BACKWARD_ALL_GATHER) for i in timeline.intervals)
    reductions = sum(i.activity in (Activity.REDUCE_SCATTER, Activity.ALL_REDUCE) for i in timeline.intervals)
    return gathers, reductions


def is_event_check(size: Size) -> bool:
    """Whether ``size`` is the event check's all-gather (``sizes``), timed for itself and kept out
    of the fits of the units' collectives."""
    return size[0] is Collective.ALL_GATHER and size[3] is torch.int64


def event_check_ms(wanted: list[Size], ranks: list[Measured]) -> float | None:
    """The event check's time after compute (``in_step``); None in a world without it."""
    k = next((k for k, size in enumerate(wanted) if is_event_check(size)), None)
    return None if k is None else in_step(ranks, k)


def in_step(ranks: list[Measured], k: int) -> float:
    """Collective ``k``'s time after compute (``Beside.collective_after_compute``), the rank's that
    waited least: the others waited, besides, for the ranks that computed longer, which the
    simulated compute (the slowest rank's, ``_worst``) already holds."""
    return min(r.collectives[k].collective_after_compute for r in ranks)


def samples(wanted: list[Size], ranks: list[Measured]) -> list[CollectiveSample]:
    """Each of the units' collectives' time after compute (``in_step``), by the bytes FSDP
    passes, on the intra-node link."""
    out = []
    for k, (collective, _, numel, dtype) in enumerate(wanted):
        if is_event_check(wanted[k]):
            continue
        ms = in_step(ranks, k)
        out.append(
            CollectiveSample(collective=collective, link=Link.INTRA_NODE, nbytes=max(1, numel * dtype.itemsize), ms=ms)
        )
    return out


def sharing_one_core(wanted: list[Size], ranks: list[Measured]) -> LinkModel:
    """How a world's collectives and compute slow each other, measured in it (``Beside``, the
    worst rank's): gloo runs a group's collectives side by side
    (``one_collective_per_group=False``); each kind of collective beside compute
    (``compute_slowdown_of``, every link alike: the world is one machine) and compute beside
    collectives (``transfers_slow_compute``: ``slowdown`` over the sizes)."""
    measured = [
        (size[0], Beside.each(max, (r.collectives[k] for r in ranks)))
        for k, size in enumerate(wanted)
        if not is_event_check(size)
    ]
    beside_compute = [
        SlowdownSample(
            collective=collective,
            link=Link.INTRA_NODE,
            load=Load.COMPUTE,
            alone_ms=b.collective_alone,
            loaded_ms=b.collective_loaded,
        )
        for collective, b in measured
    ]
    return LinkModel(
        one_collective_per_group=False,
        compute_slowdown=compute_slowdown_of(beside_compute, one_node=True),
        transfers_slow_compute=slowdown(
            (b.compute_alone for _, b in measured),
            (b.compute_loaded for _, b in measured),
        ),
    )


def collective_sizes(p: Prediction, wanted: list[Size]) -> dict[tuple[int, Activity], int]:
    """``unit_collectives``, each as the index of its size in ``wanted`` (``sizes``)."""
    index = {size: k for k, size in enumerate(wanted)}
    return {key: index[size] for key, size in unit_collectives(p).items()}


def ranks_per_core(world: int) -> int:
    """How many of a world's ranks ``pin`` puts on one core (at most)."""
    return math.ceil(world / len(os.sched_getaffinity(0)))


def _worst(ranks: list[Measured]) -> list[tuple[float, float]]:
    """Each unit's compute, the slowest rank's."""
    return [(max(c[0] for c in column), max(c[1] for c in column)) for column in zip(*(r.compute for r in ranks))]


@dataclasses.dataclass(frozen=True)
class Row:
    """One world's measurement of a configuration and its simulated iteration (ms per step)."""

    name: str
    simulated: float
    """The simulated iteration plus the optimizer step, before ``InStep`` is added."""
    measured: float
    gathers: int
    reductions: int
    parts: str


@dataclasses.dataclass(frozen=True)
class InStep:
    """What a collective costs inside a training step beyond its time alone: the host issuing it
    and handing it to gloo's threads, the wake-up of a rank that computed meanwhile. The free
    parameters of the prediction, each fitted (least squares, >= 0) on the other configurations'
    rows, never on the row it predicts."""

    per_gather_ms: float
    per_reduction_ms: float

    def of(self, row: Row) -> float:
        return self.per_gather_ms * row.gathers + self.per_reduction_ms * row.reductions

    @staticmethod
    def fit(rows: list[Row]) -> InStep:
        """The non-negative least-squares fit of ``measured - simulated`` over ``rows``: of the
        unconstrained fits with both, one or neither parameter free, the best with none < 0."""
        counts = torch.tensor([[row.gathers, row.reductions] for row in rows], dtype=torch.float64)
        gaps = torch.tensor([[row.measured - row.simulated] for row in rows], dtype=torch.float64)
        candidates = [InStep(0.0, 0.0)]
        for free in ([0, 1], [0], [1]):
            solution = torch.linalg.lstsq(counts[:, free], gaps).solution.flatten().tolist()
            if min(solution) >= 0:
                values = dict(zip(free, solution))
                candidates.append(InStep(values.get(0, 0.0), values.get(1, 0.0)))
        return min(candidates, key=lambda c: sum((row.measured - row.simulated - c.of(row)) ** 2 for row in rows))


def run(
    name: str, cfg: Config, steps: int, warmup: int, repeat: int = 1, pinning: Pinning = Pinning.HOST
) -> tuple[list[Row], list[Row]]:
    """Per world started (``repeat`` of them), ``cfg`` measured and simulated (ms per step) by
    both models (``sharing_one_core``'s slowdowns, and the core's: ``core_model``), FSDP's host
    work calibrated once, on a world of one; each rank's threads pinned as ``pinning`` says."""
    p = predict(cfg)
    solo_cfg = dataclasses.replace(cfg, ranks=1)
    solo = predict(solo_cfg)
    wanted, solo_wanted = sizes(p), sizes(solo)
    (alone,) = run_world(1, measure, (solo_cfg, solo_wanted, steps, warmup, pinning), timeout=900)
    bare = simulate(solo, alone.compute, fit_table(samples(solo_wanted, [alone])), 1).iteration_ms
    host = max(0.0, alone.forward_backward_ms - bare)
    share = host / sum(u is not None for u in p.units) / 2
    where = collective_sizes(p, wanted)
    rows, core_rows = [], []
    for _ in range(repeat):
        ranks = run_world(cfg.world, measure, (cfg, wanted, steps, warmup, pinning), timeout=900)
        compute = _worst(ranks)
        with_host = [(f + share, b + share) if u is not None else (f, b) for u, (f, b) in zip(p.units, compute)]
        links = sharing_one_core(wanted, ranks)
        check = event_check_ms(wanted, ranks)
        table = fit_table(samples(wanted, ranks))
        timeline = simulate(p, with_host, table, cfg.world, links, check)
        iteration, working = timeline.iteration_ms, working_ms(timeline)
        optimizer = max(r.optimizer_alone_ms for r in ranks)
        slowest = max(ranks, key=lambda r: r.forward_backward_ms + r.optimizer_ms)
        gathers, reductions = collective_counts(timeline)
        core, core_parts = core_model(p, compute, share, table, cfg.world, check, where, ranks)
        parts = (
            f"compute {sum(f + b for f, b in compute):.2f}, host work {host:.2f} (one rank: "
            f"{alone.forward_backward_ms:.2f} measured, {bare:.2f} simulated without); iteration "
            f"{iteration:.2f} = working {working:.2f} + waiting {iteration - working:.2f}, measured "
            f"{slowest.forward_backward_ms:.2f} = {slowest.forward_backward_ms - slowest.waits_ms:.2f} + "
            f"{slowest.waits_ms:.2f}; optimizer {optimizer:.2f}, measured {slowest.optimizer_ms:.2f}; "
            f"{gathers} all-gathers, {reductions} reductions, event check {check or 0:.2f}; beside compute: all-gather "
            f"x{links.compute_slowdown.all_gather_intra:.2f}, reduce-scatter "
            f"x{links.compute_slowdown.reduce_scatter_intra:.2f}, all-reduce "
            f"x{links.compute_slowdown.all_reduce_inter:.2f}; compute beside them x{links.transfers_slow_compute:.2f}; "
            f"{slowest.core} (one rank: {alone.core}); core model: {core_parts}"
        )
        measured = slowest.forward_backward_ms + slowest.optimizer_ms
        rows.append(Row(name, iteration + optimizer, measured, gathers, reductions, parts))
        core_rows.append(Row(name, core + optimizer, measured, gathers, reductions, core_parts))
        print(
            f"{name:<46} simulated {rows[-1].simulated:>8.2f}, core model {core_rows[-1].simulated:>8.2f}, "
            f"measured {measured:>8.2f} ms  {parts}",
            flush=True,
        )
    return rows, core_rows


def core_model(
    p: Prediction,
    compute: list[tuple[float, float]],
    share: float,
    table: object,
    world: int,
    check: float | None,
    where: dict[tuple[int, Activity], int],
    ranks: list[Measured],
) -> tuple[float, str]:
    """The iteration (ms) with the rank's core as the shared resource: collectives and compute
    slow nothing in the simulation (``GLOO``); the host work calibrated on one rank is stretched
    by the ranks ``pin`` puts on one core (``ranks_per_core``: they take turns; the compute,
    timed on every rank at once, holds that already); and the processor work of the collectives
    (``Beside.processor_ms``, the worst rank's), of every rank on the core, is added where it
    overlaps the host's work (``IterationTimeline.work_beside_compute_ms``). With what it was made of."""
    k = ranks_per_core(world)
    stretched = [(f + k * share, b + k * share) if u is not None else (f, b) for u, (f, b) in zip(p.units, compute)]
    timeline = simulate(p, stretched, table, world, GLOO, check)
    processor = [max(r.collectives[i].processor_ms for r in ranks) for i in range(len(ranks[0].collectives))]

    def of(interval: Interval) -> float:
        unit = -1 if interval.activity is Activity.EVENT_CHECK else interval.unit
        return processor[where[(unit, interval.activity)]]

    beside = k * timeline.work_beside_compute_ms(of)
    total = sum(of(i) for i in timeline.intervals if i.activity.is_collective)
    return timeline.iteration_ms + beside, (
        f"{timeline.iteration_ms:.2f} + collectives' processor work beside the host's {beside:.2f} "
        f"(of {total:.2f} per rank, {k} rank(s) per core)"
    )


def summarize(title: str, names: list[str], rows: list[Row], repeat: int) -> None:
    """Predicted / measured per configuration (simulated + ``InStep`` fitted on the others)."""
    print(f"\n{title}: predicted = simulated + in-step costs fitted on the other configurations:")
    ratios, bare, means = [], [], []
    for name in names:
        mine = [r for r in rows if r.name == name]
        fitted = InStep.fit([r for r in rows if r.name != name])
        predictions = [r.simulated + fitted.of(r) for r in mine]
        means.append(statistics.fmean(predictions) / statistics.fmean(r.measured for r in mine))
        for row, predicted in zip(mine, predictions):
            ratios.append(predicted / row.measured)
            bare.append(row.simulated / row.measured)
            print(
                f"{name:<46} {predicted:>8.2f} / {row.measured:>8.2f} ms  {ratios[-1]:.3f}  (simulated "
                f"{row.simulated:.2f}; {fitted.per_gather_ms:.3f} ms per all-gather, "
                f"{fitted.per_reduction_ms:.3f} per reduction)"
            )
        if len(mine) > 1:
            measured = [r.measured for r in mine]
            print(f"{name:<46} measured max / min over {len(mine)} worlds: {max(measured) / min(measured):.3f}")
    everything = InStep.fit(rows)
    print(
        f"in-step costs fitted on every row: {everything.per_gather_ms:.3f} ms per all-gather, "
        f"{everything.per_reduction_ms:.3f} ms per reduction"
    )
    print(f"simulated / measured: {min(bare):.3f} - {max(bare):.3f}, median {statistics.median(bare):.3f}")
    print(f"predicted / measured: {min(ratios):.3f} - {max(ratios):.3f}, median {statistics.median(ratios):.3f}")
    print(f"within 10%: {sum(abs(r - 1) <= 0.1 for r in ratios)} of {len(ratios)}")
    if repeat > 1:
        print(
            f"within 10% of each world's measurement, a configuration's mean over its own {repeat} worlds: "
            f"{own_mean_within(rows)} of {len(rows)} (how closely this machine lets any prediction agree)"
        )
        print(
            f"per configuration, the mean prediction over its {repeat} worlds / their mean measured: "
            f"{min(means):.3f} - {max(means):.3f}, median {statistics.median(means):.3f}; within 10%: "
            f"{sum(abs(m - 1) <= 0.1 for m in means)} of {len(means)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1, help="worlds started per configuration")
    parser.add_argument(
        "--pin",
        choices=[p.value for p in Pinning],
        default=Pinning.HOST.value,
        help="which of a rank's threads stay on its core (Pinning)",
    )
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    if len(names) < 3:
        parser.error("--configs: give at least 3 (each is predicted from the others' in-step costs)")
    pinning = Pinning(args.pin)
    rows, core_rows = [], []
    for name in names:
        mine, core_mine = run(name, CONFIGS[name], args.steps, args.warmup, args.repeat, pinning)
        rows += mine
        core_rows += core_mine
    summarize("measured slowdowns (sharing_one_core)", names, rows, args.repeat)
    summarize("the core's model (core_model)", names, core_rows, args.repeat)


def own_mean_within(rows: list[Row], tolerance: float = 0.1) -> int:
    """How many rows' measured time is within ``tolerance`` of their configuration's mean
    measured time over its worlds: the agreement a prediction that knew each configuration's
    mean step time, but not which world it would run in, would reach."""
    means = {name: statistics.fmean(r.measured for r in rows if r.name == name) for name in {r.name for r in rows}}
    return sum(abs(means[r.name] / r.measured - 1) <= tolerance for r in rows)


if __name__ == "__main__":
    main()
