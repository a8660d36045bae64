"""An exact, event-driven run of tasks that wait for each other and share links.

A task is either compute (it takes ``work`` ms) or a transfer on a ``Link`` (``work`` is the ms it
takes alone on that link at capacity 1). A task starts as soon as every task it comes ``after``
has ended. A transfer's progress rate is its link's capacity, then:

- *Sharing a link.* Transfers active on one link at the same time share it by processor sharing:
  with ``k`` of them active on a link of capacity ``c``, each progresses at ``c / k`` when
  ``k == 1`` and at ``c / (k * contention)`` when ``k >= 2`` (``contention == 1``: ideal
  sharing, no loss; a larger value: what sharing costs beyond splitting the bandwidth).
- *Across links* (``cross_link_slowdown``). While any transfer is active on ``INTER_NODE``,
  every transfer on ``INTRA_NODE`` progresses ``cross_link_slowdown`` times slower (1: the links
  are independent). One-sided, as measured on the emulated cluster (``benchmarks/
  bench_hsdp_cluster.py --calibrate``): there the intra-node collectives are the processor's
  work (memory copies through the node's loopback) and a concurrent inter-node one takes some
  of it, while the inter-node collectives are paced by their rate-limited link and an
  intra-node one beside them does not measurably slow them.
- *Beside compute* (``SimTask.compute_slowdown``). While any compute task is active, a
  transfer progresses its own ``compute_slowdown`` times slower (1: compute does not slow it).
  Where ranks share processor cores with their communication, as on the emulated cluster,
  collectives overlapped with computation take longer, by how much depending on the collective
  (an all-gather in many small steps more than an all-to-all), so the factor is per transfer.
- *Compute beside transfers* (``transfers_slow_compute``). While any transfer is active, every
  compute task progresses this many times slower (1, the default: a compute task's ``work`` is
  its time measured where it runs, with whatever runs beside it, as on GPUs, where NCCL's
  kernels take few SMs). Above 1 where a rank's communication is its own processor's work (gloo
  on a CPU: the worker threads copy, sum and make the socket calls on the core the rank
  computes on).

The factors multiply. Rates change only when a task starts or ends, so the run steps from one
such event to the next.

Arithmetic is in ``fractions.Fraction``: times are exact, simultaneous ends are detected exactly,
and equal inputs give equal outputs on every machine. Nothing here knows about FSDP; the
iteration simulator (``fsdp_core.sim.iteration``) builds the tasks.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import assert_never

from fsdp_core.plan.ops import Group
from fsdp_core.spec.layout import ShardingSpec

__all__ = ["Link", "SimTask", "group_link", "run_tasks", "span_link"]


class Link(enum.Enum):
    """Where a collective's bytes travel."""

    INTRA_NODE = "intra_node"
    """The node's own fabric (NVLink/NVSwitch): a shard group that fits on one node."""
    INTER_NODE = "inter_node"
    """The network between nodes: any group with ranks on several nodes."""


def span_link(ranks: int, ranks_per_node: int) -> Link:
    """The link a collective over ``ranks`` consecutive ranks uses when ``ranks_per_node`` of them
    share a node."""
    return Link.INTRA_NODE if ranks <= ranks_per_node else Link.INTER_NODE


def group_link(group: Group, sharding: ShardingSpec, ranks_per_node: int) -> Link:
    """The link ``group``'s collectives use: the shard group is consecutive ranks, the replicate
    group one rank of each shard group, spanning the whole world."""
    match group:
        case Group.SHARD:
            return span_link(sharding.shard_size, ranks_per_node)
        case Group.REPLICATE:
            return span_link(sharding.data_parallel_size, ranks_per_node)
        case _:
            assert_never(group)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimTask:
    """One task of a run."""

    after: tuple[int, ...]
    """Indices of tasks that must end before this one starts; each below this task's own index,
    so a list of tasks is always in an order in which it can run."""
    work: Fraction
    """Compute: its duration in ms. Transfer: the ms it takes alone on its link at capacity 1."""
    link: Link | None = None
    """The link a transfer uses; None for compute."""
    compute_slowdown: Fraction = Fraction(1)
    """A transfer: how many times slower it progresses while any compute task is active (>= 1).
    Compute: 1."""

    def __post_init__(self) -> None:
        if not isinstance(self.work, Fraction) or self.work < 0:
            raise ValueError(f"work: expected a Fraction >= 0, got {self.work!r}")
        if (
            not isinstance(self.compute_slowdown, Fraction)
            or self.compute_slowdown < 1
            or (self.link is None and self.compute_slowdown != 1)
        ):
            raise ValueError(
                f"compute_slowdown: expected a Fraction >= 1 (1 for compute), got {self.compute_slowdown!r}"
            )
        if not isinstance(self.after, tuple) or not all(isinstance(a, int) and a >= 0 for a in self.after):
            raise ValueError(f"after: expected a tuple of task indices, got {self.after!r}")


def run_tasks(
    tasks: Sequence[SimTask],
    *,
    capacity: Mapping[Link, Fraction],
    contention: Fraction = Fraction(1),
    cross_link_slowdown: Fraction = Fraction(1),
    transfers_slow_compute: Fraction = Fraction(1),
) -> tuple[tuple[Fraction, Fraction], ...]:
    """``(start, end)`` of every task, in ms from 0, in the order of ``tasks``.

    ``capacity`` gives each link's bandwidth relative to the one at which ``work`` was timed (it
    must name every link a task uses, each > 0); ``contention``, ``cross_link_slowdown`` and
    ``transfers_slow_compute`` (each >= 1; defaults: no loss) are the slowdowns described in the
    module docstring. Raises ``ValueError`` for a task that comes after itself or a later task,
    or for a bad capacity or slowdown. Tasks ready at the same instant start in index order; the
    result does not depend on it.
    """
    for name, factor in (
        ("contention", contention),
        ("cross_link_slowdown", cross_link_slowdown),
        ("transfers_slow_compute", transfers_slow_compute),
    ):
        if factor < 1:
            raise ValueError(f"{name}: expected >= 1, got {factor}")
    for index, task in enumerate(tasks):
        if any(a >= index for a in task.after):
            raise ValueError(f"tasks[{index}].after: expected indices below {index}, got {task.after}")
        if task.link is not None and capacity.get(task.link, Fraction(0)) <= 0:
            raise ValueError(
                f"capacity: expected a positive capacity for {task.link.value}, got {capacity.get(task.link)}"
            )
    n = len(tasks)
    start: list[Fraction | None] = [None] * n
    end: list[Fraction | None] = [None] * n
    unmet = [len(set(t.after)) for t in tasks]
    dependents: list[list[int]] = [[] for _ in range(n)]
    for index, task in enumerate(tasks):
        for a in set(task.after):
            dependents[a].append(index)
    ready = [i for i in range(n) if unmet[i] == 0]
    computing: dict[int, Fraction] = {}  # running compute task -> the work it has left
    sending: dict[int, Fraction] = {}  # running transfer -> the work it has left
    now = Fraction(0)
    finished = 0

    def finish(index: int) -> None:
        nonlocal finished
        end[index] = now
        finished += 1
        for d in dependents[index]:
            unmet[d] -= 1
            if unmet[d] == 0:
                ready.append(d)

    while finished < n:
        while ready:
            ready.sort()
            index = ready.pop(0)
            task = tasks[index]
            start[index] = now
            if task.work == 0:
                finish(index)
            elif task.link is None:
                computing[index] = task.work
            else:
                sending[index] = task.work
        if finished == n:
            break
        sharing: dict[Link, int] = {}
        for index in sending:
            link = _link(tasks[index])
            sharing[link] = sharing.get(link, 0) + 1
        across = cross_link_slowdown if Link.INTER_NODE in sharing else Fraction(1)
        speed: dict[int, Fraction] = {}
        for index in sending:
            task = tasks[index]
            link = _link(task)
            rate = _rate(capacity[link], sharing[link], contention)
            if link is Link.INTRA_NODE:
                rate /= across
            if computing:
                rate /= task.compute_slowdown
            speed[index] = rate
        pace = Fraction(1) / transfers_slow_compute if sending else Fraction(1)
        steps = [left / pace for left in computing.values()] + [left / speed[i] for i, left in sending.items()]
        assert steps, "tasks wait for tasks that never end"  # unreachable: every `after` points back
        elapsed = min(steps)
        now += elapsed
        for index in sorted(computing):
            computing[index] -= elapsed * pace
            if computing[index] == 0:
                del computing[index]
                finish(index)
        for index in sorted(sending):
            sending[index] -= elapsed * speed[index]
            if sending[index] == 0:
                del sending[index]
                finish(index)
    out: list[tuple[Fraction, Fraction]] = []
    for s, e in zip(start, end):
        assert s is not None and e is not None
        out.append((s, e))
    return tuple(out)


def _link(task: SimTask) -> Link:
    assert task.link is not None
    return task.link


def _rate(capacity: Fraction, active: int, contention: Fraction) -> Fraction:
    """How fast each of ``active`` transfers on a link of ``capacity`` progresses."""
    return capacity if active == 1 else capacity / (active * contention)
