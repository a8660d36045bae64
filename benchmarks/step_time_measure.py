"""Step-time benchmark, its measurements: the sizes a prediction needs, timing primitives, how
collectives and compute share a core (``Beside``), pinning, and one world's ``measure`` of a
configuration (``benchmarks/bench_step_time.py``'s docstring says what and why)."""

from __future__ import annotations

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

from fsdp_core import Group, all_gather_volume, comm_volume
from fsdp_core.execution import gather_by_broadcasts
from fsdp_core.memory import optimized_tensors
from fsdp_core.plan.planner import build_plan
from fsdp_core.sim import (
    Activity,
    Collective,
    event_check_volume,
)
from fsdp_shell import FSDP
from fsdp_shell.memory.workload import Config, loss_of, model_of, optimizer_of, wrap
from fsdp_shell.predict import Prediction
from fsdp_shell.predict.against import predict
from fsdp_shell.predict.trace import TraceUnit, time_trace
from fsdp_shell.runtime.collectives import Pending, all_gather_flat, broadcast_gather
from fsdp_shell.runtime.cpu import gloo_reduce_scatter
from fsdp_shell.units.build import find_units, param_names, unit_params

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
        if gather_by_broadcasts(out.nbytes):  # the runtime's form for large gathers
            return lambda: Pending(broadcast_gather(out, mine, groups.gather_group))
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
    model = wrap("ours", cfg)
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
                with host_waits(waited), contextlib.nullcontext() if sync else model.no_sync():
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
        module, _ = model_of(cfg)
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
