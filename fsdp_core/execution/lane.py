"""How the CPU runtime executes plans: where it runs each op of a plan, when it returns the memory
a plan frees, and the forms gloo's collectives take.

There is no device queue on a CPU, so an op runs on the host thread that reaches it, unless it
must wait for a collective in flight: then it goes to the *lane*, one FIFO worker thread that
waits for the collective and runs what depends on it while the hook returns and autograd goes
on. Lane work is numbered by a *ticket* in submission order.

The rules (``LaneOrder``, one method each):

- **Behind.** Work is behind when a stream or group it runs on, or a tensor it uses, has lane
  work the host has not waited for.
- ``compute``: work behind goes to the lane (stream order, as on a CUDA stream: the next unit's
  cast waits behind this unit's all-reduce on the post-backward stream); other work runs on the
  host.
- ``collective``: the replicate group's collectives always go to the lane (the slow inter-node
  all-reduce overlaps later backward work). A shard-group collective that is behind goes to the
  lane when the lane issues that group too (``lane_issues_shard``); otherwise the host first
  waits for the whole lane (``Place.HOST_AFTER_DRAIN``) and then issues it itself: a shard-group
  reduction left in flight would hold a unit's unsharded gradient while the next unit's backward
  allocates its own, which on a CPU buys no speed on gloo and costs that much peak memory over
  FSDP1. Either way each group's collectives are issued by one thread at a time, in program
  order, so they pair up across ranks whatever the timing.
- ``on_host``: work that touches the parameter or its ``.grad`` runs on the host, after the whole
  lane when it is behind.
- ``free``: a buffer lane work still uses is returned only when the host has waited for that
  work; others at once.
- ``begin_plan``: when a plan starts, the host waits for the lane work of plans more than
  ``PLANS_IN_FLIGHT`` back, and only then returns what they freed.
- ``drain``: at the end of backward (and before a shard-group collective behind) the host waits
  for everything.

What the host "has waited for" moves only at ``begin_plan`` and ``drain``, never because the lane
happens to be done, so where work runs and when memory returns follow from program order alone:
the memory model and the simulator fold over this same class and predict the runtime exactly.

**gloo's forms** (``scatter_form``, ``gather_by_broadcasts``, ``gather_waits``). Gloo has no
summing reduce-scatter of its own (torch emulates it with an all-reduce of a copy of the input:
twice the bytes, one more buffer). The CPU runtime reduce-scatters by all-to-all into a receive
buffer the size of the input and sums the chunks locally (the bytes of a ring reduce-scatter,
4-8x faster on loopback: ``benchmarks/bench_collectives.py``), except where the input is large and
dies with the collective:
then an in-place all-reduce of the input needs no buffer beyond it, as the unsharded gradient
dominates memory there.

All-gathers of ``BROADCAST_GATHER_MIN_BYTES`` and more go as one broadcast per rank, each
straight into its slice of the output (``gather_by_broadcasts``): the same bytes, received with no
buffer of gloo's; on loopback they took 0.65-0.94 of gloo's all-gather time from 2 MiB up on 2 and
4 ranks, and up to 1.18x below 1 MiB (``benchmarks/bench_collectives.py --gather``, 11 rounds).

All-gathers stay in flight while the host goes on (prefetch) up to ``ASYNC_GATHER_MAX_BYTES``;
larger ones land before the call returns: gloo gathers through a temporary buffer of the
output's size (not a tensor of ours), and a large one in flight during the next unit's backward
raised the peak above FSDP1's, which is synchronous on CPU (``benchmarks/bench_training.py``,
"large").

The runtime (``fsdp_shell.runtime.cpu``) asks these functions what to do; the memory model and
the simulator ask the same ones what it did.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

from fsdp_core.plan.ops import Group, Stream
from fsdp_core.spec.config import HybridAllReduce
from fsdp_core.spec.division import ReduceKind

__all__ = [
    "ALL_TO_ALL_MAX_BYTES",
    "ASYNC_GATHER_MAX_BYTES",
    "PLANS_IN_FLIGHT",
    "LaneOrder",
    "Place",
    "ScatterForm",
    "gather_waits",
    "lane_issues_shard",
    "scatter_form",
]

PLANS_IN_FLIGHT = 1
"""How many earlier units' post-backward plans may still have lane work outstanding when a
unit's plan starts: the unit before's hybrid all-reduce overlaps this unit's reduce-scatter and
backward, and at most this many plans' buffers are held for work in flight."""

T = TypeVar("T")

Key = Stream | Group


class Place(enum.Enum):
    """Where the runtime runs one op of a plan."""

    STREAM = "stream"
    """On its stream (a device's streams)."""
    HOST = "host"
    """On the CPU's host thread, which waits for a collective there."""
    LANE = "lane"
    """On the CPU's lane thread, in order behind earlier lane work."""
    HOST_AFTER_DRAIN = "host_after_drain"
    """On the host thread, once it has waited for all the lane's work."""


def lane_issues_shard(hybrid_all_reduce: HybridAllReduce) -> bool:
    """Whether the CPU lane issues shard-group reductions too: with the replicate all-reduce on the
    post-backward stream (``SYNC``) the next reduce-scatter queues behind it, and the host must
    not block on it; the all-gathers then get a group of their own, so that each group keeps one
    issuer."""
    return hybrid_all_reduce is HybridAllReduce.SYNC


class LaneOrder(Generic[T]):
    """The lane's placement state and its decisions (module docstring).

    Uses are any hashable identity of a buffer (the runtime: a tensor's ``id``; the memory model:
    a buffer's name in its plan). What a ``free`` defers is an item of the caller's (``T``), given
    back by ``begin_plan``'s wait (``waited_through``) or ``drain`` when its memory returns."""

    def __init__(self, *, lane_issues_shard: bool = False) -> None:
        self.lane_issues_shard = lane_issues_shard
        self._lane_groups = frozenset({Group.REPLICATE, Group.SHARD} if lane_issues_shard else {Group.REPLICATE})
        self.submitted = 0
        """The ticket of the last work sent to the lane (0: none)."""
        self.waited = 0
        """The host has waited for the lane work through this ticket."""
        self._tail: dict[Key, int] = {}
        self._last_use: dict[Hashable, int] = {}
        self._plan_marks: deque[int] = deque(maxlen=PLANS_IN_FLIGHT + 1)
        self._frees: list[tuple[int, T]] = []

    def fork(self) -> LaneOrder[T]:
        """An independent copy of the state (the items deferred are shared)."""
        other: LaneOrder[T] = LaneOrder(lane_issues_shard=self.lane_issues_shard)
        other.submitted, other.waited = self.submitted, self.waited
        other._tail, other._last_use = dict(self._tail), dict(self._last_use)
        other._plan_marks.extend(self._plan_marks)
        other._frees = list(self._frees)
        return other

    def behind(self, keys: Iterable[Key], uses: Iterable[Hashable]) -> bool:
        """Whether work on ``keys`` using ``uses`` must wait for lane work not yet waited for."""
        waited = self.waited
        return any(self._tail.get(k, 0) > waited for k in keys) or any(self._last_use.get(u, 0) > waited for u in uses)

    def keys_behind(self) -> frozenset[Key]:
        """The streams and groups with lane work the host has not waited for."""
        return frozenset(k for k, t in self._tail.items() if t > self.waited)

    def _to_lane(self, keys: Iterable[Key], uses: Iterable[Hashable]) -> Place:
        self.submitted += 1
        for key in keys:
            self._tail[key] = self.submitted
        for use in uses:
            self._last_use[use] = self.submitted
        return Place.LANE

    def compute(self, stream: Stream, uses: tuple[Hashable, ...]) -> Place:
        """Element-wise work on ``stream``: ``LANE`` (its ticket is ``submitted``) or ``HOST``."""
        if self.behind((stream,), uses):
            return self._to_lane((stream,), uses)
        return Place.HOST

    def collective(self, stream: Stream, group: Group, uses: tuple[Hashable, ...]) -> Place:
        """A collective on ``group``: ``LANE``, ``HOST``, or ``HOST_AFTER_DRAIN`` (the caller then
        waits for the whole lane and calls ``drain`` before issuing it)."""
        keys = (stream, group)
        behind = self.behind(keys, uses)
        if group is Group.REPLICATE or (behind and group in self._lane_groups):
            return self._to_lane(keys, uses)
        return Place.HOST_AFTER_DRAIN if behind else Place.HOST

    def on_host(self, uses: tuple[Hashable, ...]) -> Place:
        """Host work on ``uses``: ``HOST``, or ``HOST_AFTER_DRAIN`` (the caller drains first)."""
        return Place.HOST_AFTER_DRAIN if self.behind((), uses) else Place.HOST

    def free(self, use: Hashable, item: T) -> bool:
        """A plan frees the buffer ``use``: True when its memory returns now, else ``item`` is kept
        until the host has waited for the lane work that last used it."""
        ticket = self._last_use.get(use, 0)
        if ticket > self.waited:
            self._frees.append((ticket, item))
            return False
        return True

    def pending(self) -> list[T]:
        """What is freed and not yet returned, oldest first."""
        return [item for _, item in self._frees]

    def begin_plan(self) -> int:
        """A plan starts: the ticket the host must wait through now (``<= waited``: none); the
        caller waits, then calls ``waited_through`` with it."""
        marks = self._plan_marks
        marks.append(self.submitted)
        return marks[0] if len(marks) == marks.maxlen else 0

    def waited_through(self, ticket: int) -> list[T]:
        """The host has waited for the lane work through ``ticket``: what returns now."""
        if ticket <= self.waited:
            return []
        self.waited = ticket
        due = [item for t, item in self._frees if t <= ticket]
        self._frees = [(t, item) for t, item in self._frees if t > ticket]
        return due

    def drain(self) -> list[T]:
        """The host has waited for the whole lane: what returns now (everything pending)."""
        self._tail.clear()
        self._last_use.clear()
        self._plan_marks.clear()
        self.waited = self.submitted
        due, self._frees = [item for _, item in self._frees], []
        return due


# -- gloo's forms ----------------------------------------------------------------------------------

ALL_TO_ALL_MAX_BYTES = 4 << 20
"""Summing reduce-scatters on gloo with inputs up to this size go by all-to-all into a receive
buffer; larger ones reduce their input in place when it dies with them."""

ASYNC_GATHER_MAX_BYTES = 4 << 20
"""On gloo, all-gathers with outputs up to this size stay in flight while the host goes on."""

BROADCAST_GATHER_MIN_BYTES = 2 << 20
"""On gloo, all-gathers with outputs of at least this size go as one broadcast per rank, each
into its slice of the output (``gather_by_broadcasts``)."""


class ScatterForm(enum.Enum):
    """How a reduce-scatter runs, and whether it holds a receive buffer the size of its input
    while it runs (``receive_buffer``)."""

    NATIVE = ("native", False)
    """The backend's own reduce-scatter (any op but a sum on gloo)."""
    ALL_TO_ALL = ("all_to_all", True)
    """All-to-all into a receive buffer the size of the input, then a local sum of the chunks."""
    ALL_REDUCE = ("all_reduce", False)
    """An in-place all-reduce of the input, then a copy of this rank's chunk."""
    LOCAL = ("local", False)
    """A group of one rank: the input copied into the output, no collective (a sum or an average
    over one rank is the input)."""

    def __init__(self, label: str, receive_buffer: bool) -> None:
        self.label = label
        self.receive_buffer = receive_buffer


def scatter_form(kind: ReduceKind, src_bytes: int, *, gloo: bool, src_dies: bool, ranks: int = 2) -> ScatterForm:
    """The form of a reduce-scatter of ``src_bytes`` with reduction ``kind`` over ``ranks``
    ranks; ``src_dies``: no op after it uses its input before the plan frees it
    (``fsdp_core.plan.request.dies_after``). Over one rank a sum or an average is a copy
    (FSDP1 runs no collective for ``NO_SHARD``'s one rank either, FSDP2 none at world size 1)."""
    if ranks == 1 and kind in (ReduceKind.SUM, ReduceKind.AVG):
        return ScatterForm.LOCAL
    if not gloo or kind is not ReduceKind.SUM:
        return ScatterForm.NATIVE
    if src_dies and src_bytes > ALL_TO_ALL_MAX_BYTES:
        return ScatterForm.ALL_REDUCE
    return ScatterForm.ALL_TO_ALL


def gather_waits(output_bytes: int) -> bool:
    """Whether the host waits for a gloo all-gather of ``output_bytes`` before going on."""
    return output_bytes > ASYNC_GATHER_MAX_BYTES


def gather_by_broadcasts(output_bytes: int) -> bool:
    """Whether a gloo all-gather of ``output_bytes`` goes as one broadcast per rank into the
    output's slices instead of gloo's all-gather (which gathers through a buffer of its own):
    from ``BROADCAST_GATHER_MIN_BYTES`` up, where the broadcasts are faster on loopback
    (``benchmarks/bench_collectives.py --gather``)."""
    return output_bytes >= BROADCAST_GATHER_MIN_BYTES
