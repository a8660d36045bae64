"""The flat-tensor collectives: all-gather, reduce-scatter and all-reduce, an issued collective
(``Pending``), the plan's reduce ops as ``torch.distributed``'s, and the log of what a rank
issues (``CollectiveLog``).

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single``; torch 2.4 has only the old names. We call the
new names where torch has them and the old ones where it has only those, so no call warns.

**Synchronous means released.** gloo's run-loop thread keeps a collective's ``Work``, and with it
a reference to every tensor of the collective, for a moment after ``wait()`` returns. If the
program has dropped such a tensor meanwhile, the run loop frees it, and freeing a tensor that
Python once held takes the GIL. During interpreter shutdown that thread cannot have the GIL:
Python ends it with ``pthread_exit``, which unwinds through C++ and aborts the process
("terminate called without an active exception"; 6 of 16 runs of a plain torch script that ends
right after an ``all_gather_into_tensor``). So every synchronous collective of this library
returns only once gloo's threads hold none of its tensors (``completed``), and a script that ends
right after one (``model.state_dict()``) exits cleanly.

**The log.** What one rank's runtime issues, collective by collective: counted by kind (op,
group, dtype and size, for as long as the process runs) and shown to whoever watches.

Nothing here grows with the number of steps: the counts have one entry per kind of collective,
and a record of each collective exists only while someone watches (``watching``), kept in the
watcher's own list. The demo counts its traffic from the totals; tests watch the issue order
(each group's sequence must be the same on every rank). Collectives are added by the host thread
and by the lane; within one group there is one issuer, so each group's sequence is its issue
order.
"""

from __future__ import annotations

import contextlib
import enum
import pickle
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Protocol, assert_never

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _make_nccl_premul_sum

from fsdp_core import Group, ReduceKind, ReduceOpSpec

__all__ = [
    "GLOO_RELEASE_TIMEOUT",
    "CollectiveKind",
    "CollectiveLog",
    "CollectiveRecord",
    "Pending",
    "Phase",
    "Waitable",
    "all_gather_flat",
    "all_gather_objects",
    "all_reduce_flat",
    "any_rank",
    "broadcast_flat",
    "broadcast_gather",
    "completed",
    "reduce_scatter_flat",
    "release",
    "to_reduce_op",
    "use_count",
]

_ALL_GATHER: Callable[..., dist.Work | None] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``torch.distributed``'s flat all-gather under its newest name (module docstring)."""
_REDUCE_SCATTER: Callable[..., dist.Work | None] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)
"""``torch.distributed``'s flat reduce-scatter under its newest name (module docstring)."""


class Waitable(Protocol):
    """What an issued collective is waited on through: a ``torch.distributed`` ``Work``, or on an
    accelerator an event the current stream waits for."""

    def wait(self) -> object:
        """Until the result is in place (on an accelerator: for the current stream)."""


@dataclass(frozen=True, slots=True, eq=False)
class Pending:
    """An issued asynchronous collective: its ``Work``, the tensors it reads and writes (held
    here, so they live until it has completed whatever else drops them), and ``then``, the local
    step that completes the result once the transfer has landed (for example summing received
    chunks). ``wait`` blocks the host (on CUDA: the current stream) until the result is in place."""

    work: Waitable
    operands: tuple[torch.Tensor, ...] = ()
    then: Callable[[], None] | None = None

    def wait(self) -> None:
        """Until the collective's result is in place."""
        self.work.wait()
        if self.then is not None:
            self.then()


def to_reduce_op(spec: ReduceOpSpec) -> dist.ReduceOp:
    """The ``torch.distributed`` reduce op for ``spec``."""
    match spec.kind:
        case ReduceKind.SUM:
            return dist.ReduceOp(dist.ReduceOp.SUM)
        case ReduceKind.AVG:
            return dist.ReduceOp(dist.ReduceOp.AVG)
        case ReduceKind.PREMUL_SUM:
            return _make_nccl_premul_sum(spec.premul)
        case _:
            assert_never(spec.kind)


GLOO_RELEASE_TIMEOUT = 1.0
"""Seconds ``completed`` waits at most for gloo's threads to let go of a collective's tensors
(they do within microseconds once scheduled; the bound only keeps a surprise from hanging)."""


def use_count(t: torch.Tensor) -> int:
    """How many C++ references ``t``'s tensor has (the Python object holds one)."""
    return int(t._use_count())  # type: ignore[attr-defined]  # private, not in torch's stubs


_USE_COUNT: Callable[[torch.Tensor], int] = torch.Tensor._use_count  # type: ignore[attr-defined]  # private, not in torch's stubs


def completed(
    issue: Callable[[], object], uses: Sequence[torch.Tensor], announce: Callable[[], None] | None = None
) -> None:
    """Issue a collective (``issue`` returns its ``Work`` or a ``Pending``, or None when it ran
    synchronously), wait for it, then until the backend's threads hold none of ``uses``: each
    host tensor's count of C++ references back to what it was before the issue (module
    docstring). Device tensors are left to their streams. ``announce`` runs on the issuing
    thread right before the issue (a runtime's ``CollectiveLog.add``)."""
    host = [t for t in uses if t.device.type == "cpu"]
    held = [_USE_COUNT(t) for t in host]
    if announce is not None:
        announce()
    work = issue()
    if work is None:
        return
    work.wait()  # type: ignore[attr-defined]  # a Work or a Pending: both wait
    del work
    deadline = time.monotonic() + GLOO_RELEASE_TIMEOUT
    while any(_USE_COUNT(t) > n for t, n in zip(host, held)) and time.monotonic() < deadline:
        time.sleep(0)  # lets the backend's thread take the GIL it may need


def all_gather_flat(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """Gather every rank's ``input`` into ``output`` (rank order); synchronous unless
    ``async_op``, and then ``completed``."""
    if async_op:
        return _ALL_GATHER(output, input, group=group, async_op=True)
    completed(partial(_ALL_GATHER, output, input, group=group, async_op=True), (output, input))
    return None


class _AllDone:
    """Several collectives' ``Work`` as one ``Waitable``."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True


def broadcast_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> Waitable:
    """Gather every rank's ``input`` into ``output`` (rank order) as one asynchronous broadcast per
    rank, each into its slice of ``output`` (this rank's slice is ``input``'s copy, unless
    ``input`` is that slice already): the form ``fsdp_core.execution.gather_by_broadcasts``
    chooses for large gloo all-gathers."""
    n, me = input.numel(), group.rank()
    works = []
    for r in range(group.size()):
        chunk = output.narrow(0, r * n, n)
        if r == me and chunk.data_ptr() != input.data_ptr():
            chunk.copy_(input)
        works.append(dist.broadcast(chunk, src=dist.get_global_rank(group, r), group=group, async_op=True))
    return _AllDone(works)


def all_gather_objects(obj: object, group: dist.ProcessGroup) -> list[object]:
    """Every rank's ``obj`` in rank order, over a gloo ``group``: ``dist.all_gather_object`` with
    ``completed`` collectives, so its buffers are returned at a fixed point of the program (torch's
    leaves them to gloo's threads, and a rank's memory would then depend on their timing)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = group.size()
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    lengths = torch.empty(size, dtype=torch.int64)
    all_gather_flat(lengths, length, group)
    counts = lengths.tolist()
    longest = max(counts)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = torch.empty(size * longest, dtype=torch.uint8)
    all_gather_flat(gathered, padded, group)
    out = [pickle.loads(bytes(gathered[r * longest : r * longest + n].tolist())) for r, n in enumerate(counts)]
    release(length, lengths, padded, gathered)
    return out


def all_reduce_flat(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp | dist.ReduceOp.RedOpType | None = None
) -> None:
    """Reduce ``tensor`` in place over ``group`` (default: sum), synchronously and ``completed``."""
    reduce_op = dist.ReduceOp.SUM if op is None else op
    completed(lambda: dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True), (tensor,))


def broadcast_flat(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """``tensor`` from global rank ``src`` to every rank of ``group``, synchronously and
    ``completed``."""
    completed(lambda: dist.broadcast(tensor, src=src, group=group, async_op=True), (tensor,))


def any_rank(flag: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank of ``group`` (a collective: every rank calls it)."""
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    all_reduce_flat(t, group, dist.ReduceOp.MAX)
    agreed = bool(t.item())
    release(t)
    return agreed


def release(*tensors: torch.Tensor) -> None:
    """Give back the memory of host tensors a completed collective used and nothing else will:
    gloo's threads may still hold them for a moment after the collective has completed, so
    dropping the last reference here would free them at a time that depends on those threads."""
    for t in tensors:
        storage = t.untyped_storage()
        if t.device.type == "cpu" and storage.size() != 0:
            storage.resize_(0)


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce ``input`` across ranks and leave this rank's chunk in ``output``; synchronous
    unless ``async_op``, and then ``completed``."""
    issue = partial(
        _REDUCE_SCATTER, output, input, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=True
    )
    if async_op:
        return issue()
    completed(issue, (output, input))
    return None


# -- the log of what this rank issues --------------------------------------------------------------


class Phase(enum.Enum):
    """Where a collective was issued, for the collective log."""

    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"
    LANE = "lane"
    END_OF_BACKWARD = "end_of_backward"
    OTHER = "other"


class CollectiveRecord(NamedTuple):
    """One collective issued by this rank."""

    op: str
    group: Group
    dtype: torch.dtype
    numel: int
    phase: Phase


class CollectiveKind(NamedTuple):
    """A kind of collective: what a rank counts them by."""

    op: str
    group: Group
    dtype: torch.dtype
    numel: int


class CollectiveLog:
    """The collectives this rank's runtime issues: ``counts`` by kind, and a ``CollectiveRecord``
    of each to every list ``watching`` has handed out.

    The host thread's collectives are recorded in the phase of the innermost ``during`` it is in
    (``OTHER`` outside any); those of the thread passed to ``mark_lane`` as ``LANE``."""

    def __init__(self) -> None:
        self.counts: dict[CollectiveKind, int] = {}
        self._watchers: tuple[list[CollectiveRecord], ...] = ()
        self._phase = Phase.OTHER
        self._lane: threading.Thread | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def during(self, phase: Phase) -> Iterator[None]:
        """Record the host thread's collectives inside as issued in ``phase``."""
        outer, self._phase = self._phase, phase
        try:
            yield
        finally:
            self._phase = outer

    @contextlib.contextmanager
    def watching(self) -> Iterator[list[CollectiveRecord]]:
        """A list that receives a record of every collective issued inside, in issue order per
        group (kept by the caller: nothing is kept here once the block ends)."""
        seen: list[CollectiveRecord] = []
        with self._lock:
            self._watchers = (*self._watchers, seen)
        try:
            yield seen
        finally:
            with self._lock:
                self._watchers = tuple(w for w in self._watchers if w is not seen)

    def mark_lane(self, thread: threading.Thread) -> None:
        """Collectives ``thread`` issues are the lane's."""
        self._lane = thread

    def add(self, op: str, group: Group, dtype: torch.dtype, numel: int) -> None:
        """Count a collective issued now, by the current thread, and show it to the watchers."""
        kind = CollectiveKind(op, group, dtype, numel)
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            watchers = self._watchers
        if watchers:
            on_lane = self._lane is not None and threading.current_thread() is self._lane
            record = CollectiveRecord(op, group, dtype, numel, Phase.LANE if on_lane else self._phase)
            for seen in watchers:
                seen.append(record)
