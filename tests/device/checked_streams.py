"""A checked-streams device: the accelerator runtime, unchanged, on CPU tensors with gloo under
it, raising on every use of a buffer that its streams do not order.

``CheckedDevice`` is a ``fsdp_shell.runtime.accelerator.Device``. Its streams run work at once,
in issue order, so results are those of the CPU; what it checks is whether a real device, which
runs each stream's work whenever it likes within the waits it was given, would produce them too.
``StreamChecker`` (a ``TorchDispatchMode``, as ``torch.cuda._sanitizer`` is) sees every ATen and
c10d op, with the stream current when it was issued, and keeps a vector clock per stream: the
last op of every stream that this stream is ordered after (a stream is ordered after its own
earlier ops, after everything the host did or waited for before issuing to it, and after what
``wait_stream``, ``wait_event`` made it wait for). Per storage it keeps the op that last wrote it, the ops that
read it since, the stream it was allocated on and the streams it was recorded on. It raises
``StreamRaceError``, naming the op and the buffer, on

- a read (or write) on one stream of data written (or read) on another with no wait or event
  in between;
- an allocation on a stream that may reuse memory freed to that stream's pool (its last
  reference dropped, or resized to nothing) while another stream's use of it was neither
  waited for by that stream nor recorded with ``record_stream``;
- a host read of data a stream wrote, before the host synchronized with an event or stream
  after it (a non-blocking device-to-host copy into a pinned buffer is such a write).

The host is a stream of its own: buffers from ``pinned_empty`` are host memory, and an op on
host memory runs on the host (except a non-blocking ``copy_`` into it, which a stream runs). A
host op that reads device memory copies it out first, which waits for the current stream
(``.item()``, ``.to("cpu")``). A storage whose allocation the checker did not see (made before
it was installed, or inside a collective, such as gloo's reduce-scatter buffer) counts as
allocated on the stream of its first use.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from fsdp_shell.runtime.accelerator import AcceleratorRuntime
from fsdp_shell.runtime.collectives import CollectiveLog
from fsdp_shell.runtime.device import set_cpu_runtime
from fsdp_shell.runtime.groups import ProcessGroups

__all__ = ["CheckedDevice", "CheckedEvent", "CheckedStream", "StreamChecker", "StreamRaceError", "checked_streams"]

HOST = 0
"""The host's index among the checker's streams."""

_HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default"})
"""Ops whose result the host reads (they copy device memory out, waiting for the current stream)."""

_ALLOCATIONS = ("aten.empty", "aten.new_empty")
"""Ops (by name prefix) that allocate memory and write none of it."""

_SWEEP_EVERY = 4096
"""Ops between sweeps of the records of storages that no longer exist."""


class StreamRaceError(AssertionError):
    """A use of a buffer that the streams, events and waits issued so far do not order."""


@dataclass(eq=False)
class CheckedStream:
    """A stream of the checked device: ``seen[i]`` is the last op of stream ``i`` this stream is
    ordered after (its own entry counts its ops)."""

    name: str
    index: int
    seen: dict[int, int] = field(default_factory=dict)

    def ordered_after(self, use: _Use) -> bool:
        return use.stream == self.index or self.seen.get(use.stream, 0) >= use.tick

    def absorb(self, seen: Mapping[int, int]) -> None:
        for stream, tick in seen.items():
            if tick > self.seen.get(stream, 0):
                self.seen[stream] = tick


@dataclass(frozen=True, eq=False)
class CheckedEvent:
    """A recorded event: what its stream had been ordered after when it was recorded."""

    seen: Mapping[int, int]


@dataclass(frozen=True)
class _Use:
    stream: int
    tick: int
    op: str


@dataclass(eq=False)
class _Storage:
    ref: StorageWeakRef
    data_ptr: int
    allocated_on: int
    what: str
    host: bool = False
    write: _Use | None = None
    reads: dict[int, _Use] = field(default_factory=dict)
    last_use: dict[int, _Use] = field(default_factory=dict)
    recorded: set[int] = field(default_factory=set)


class StreamChecker(TorchDispatchMode):  # type: ignore[no-untyped-call]  # TorchDispatchMode is unannotated in torch
    """Sees every op while entered and checks it against the streams' order (module docstring)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode is unannotated in torch
        self.streams: list[CheckedStream] = [CheckedStream("host", HOST, {HOST: 0})]
        self.default = self.new_stream("default")
        self.ops_checked = 0
        self.runtimes = 0
        """Accelerator runtimes made on this checker's device (``checked_streams``)."""
        self._local = threading.local()
        self._storages: dict[int, _Storage] = {}
        self._watched: set[int] = set()
        """Storages used on a stream other than their allocation stream: checked when freed."""
        self._reuses: dict[int, list[tuple[_Use, str]]] = {}
        """By stream: uses on other streams of memory freed to its pool, not known to be done."""

    # -- streams and events ------------------------------------------------------------------

    @property
    def host(self) -> CheckedStream:
        return self.streams[HOST]

    def new_stream(self, name: str) -> CheckedStream:
        stream = CheckedStream(name, len(self.streams))
        stream.seen[stream.index] = 0
        self.streams.append(stream)
        return stream

    def current(self) -> CheckedStream:
        stack: list[CheckedStream] = getattr(self._local, "stack", [])
        return stack[-1] if stack else self.default

    @contextlib.contextmanager
    def using(self, stream: CheckedStream) -> Iterator[None]:
        stack: list[CheckedStream] = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    def _issue(self, stream: CheckedStream) -> None:
        """The host issues work to ``stream``: it is ordered after everything the host did and
        everything the host had waited for."""
        stream.absorb(self.host.seen)

    def wait_stream(self, stream: CheckedStream, waits_for: CheckedStream) -> None:
        self._issue(stream)
        stream.absorb(waits_for.seen)

    def record_event(self, stream: CheckedStream) -> CheckedEvent:
        self._issue(stream)
        return CheckedEvent(dict(stream.seen))

    def wait_event(self, stream: CheckedStream, event: CheckedEvent) -> None:
        self._issue(stream)
        stream.absorb(event.seen)

    def host_wait(self, event: CheckedEvent) -> None:
        self.host.absorb(event.seen)

    def synchronize(self, stream: CheckedStream) -> None:
        self.host.absorb(stream.seen)

    def record_stream(self, tensor: torch.Tensor, stream: CheckedStream) -> None:
        self._record(tensor.untyped_storage(), self.current(), "").recorded.add(stream.index)

    def mark_host(self, tensor: torch.Tensor) -> None:
        record = self._record(tensor.untyped_storage(), self.host, "pinned_empty")
        record.host, record.allocated_on = True, HOST

    def is_host(self, tensor: torch.Tensor) -> bool:
        record = self._storages.get(tensor.untyped_storage()._cdata)
        return record is not None and record.host

    # -- storages ----------------------------------------------------------------------------

    def _record(self, storage: torch.UntypedStorage, stream: CheckedStream, op: str) -> _Storage:
        key = storage._cdata
        record = self._storages.get(key)
        if record is not None and record.data_ptr == storage.data_ptr():
            return record
        if record is not None:
            self._freed(key, record)
        allocated_on = stream.index
        size = f"a {storage.nbytes()}-byte buffer"
        what = f"{size} allocated by {op} on '{stream.name}'" if op else f"{size} allocated before the checker saw it"
        record = _Storage(StorageWeakRef(storage), storage.data_ptr(), allocated_on, what)  # type: ignore[no-untyped-call]  # StorageWeakRef is unannotated in torch
        self._storages[key] = record
        return record

    def _poll_frees(self) -> None:
        for key in list(self._watched):
            record = self._storages[key]
            if record.ref.expired():  # type: ignore[no-untyped-call]  # StorageWeakRef is unannotated in torch
                self._freed(key, record)
                del self._storages[key]
                continue
            storage = torch.UntypedStorage._new_with_weak_ptr(record.ref.cdata)
            if storage.nbytes() == 0 or storage.data_ptr() != record.data_ptr:
                self._freed(key, record)
                del self._storages[key]

    def _freed(self, key: int, record: _Storage) -> None:
        """``record``'s memory goes back to the pool of the stream it was allocated on: every
        use on another stream that was not recorded there becomes an obligation of that stream's
        next allocation (which may reuse the memory) to be ordered after it."""
        self._watched.discard(key)
        owner = record.allocated_on
        for index, use in record.last_use.items():
            if index not in (HOST, owner) and index not in record.recorded:
                self._reuses.setdefault(owner, []).append((use, record.what))

    def _check_reuse(self, stream: CheckedStream, op: str) -> None:
        """``op`` on ``stream`` allocates: it may reuse memory freed to ``stream``'s pool."""
        pending = self._reuses.pop(stream.index, [])
        for use, what in pending:
            if not stream.ordered_after(use):
                raise StreamRaceError(
                    f"{op} on stream '{stream.name}' allocates, and may reuse {what}, which was freed "
                    f"while {use.op} on stream '{self.streams[use.stream].name}' could still use it: "
                    f"'{stream.name}' neither waited for that use nor was the buffer recorded there "
                    "(record_stream)"
                )

    def _sweep(self) -> None:
        for key in [k for k, r in self._storages.items() if r.ref.expired()]:  # type: ignore[no-untyped-call]  # StorageWeakRef is unannotated in torch
            record = self._storages.pop(key)
            if key in self._watched:
                self._freed(key, record)

    # -- ops ---------------------------------------------------------------------------------

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return func(*args, **kwargs)
        self.ops_checked += 1
        if self.ops_checked % _SWEEP_EVERY == 0:
            self._sweep()
        self._poll_frees()
        name = str(func)
        operands = list(self._operands(func, args, kwargs))
        non_blocking_copy = name == "aten.copy_.default" and bool(
            args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        )
        on_host = name in _HOST_READS or (not non_blocking_copy and any(self.is_host(t) for t, _ in operands))
        stream = self.host if on_host else self.current()
        if on_host:
            if any(not self.is_host(t) for t, _ in operands):
                self.host.absorb(self.current().seen)
            self.host.seen[HOST] += 1
        else:
            self._issue(stream)
            stream.seen[stream.index] += 1
        use = _Use(stream.index, stream.seen[stream.index], name)
        seen: dict[int, tuple[torch.UntypedStorage, _Storage]] = {}
        for tensor, written in operands:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue
            record = self._record(storage, stream, "")
            seen[storage._cdata] = storage, record
            self._access(record, stream, use, written)
        out = func(*args, **kwargs)
        for key, (storage, record) in seen.items():
            if storage.data_ptr() != record.data_ptr:
                self._freed(key, record)
                self._check_reuse(stream, name)
                regrown = self._record(storage, stream, name)
                regrown.host = record.host
                self._access(regrown, stream, use, written=True)
        for tensor in _plain(tree_leaves(out)):
            if tensor.layout == torch.strided:
                storage = tensor.untyped_storage()
                if storage._cdata in seen or storage.nbytes() == 0:
                    continue
                self._check_reuse(stream, name)
                record = self._record(storage, stream, name)
                record.host = on_host
                if not name.startswith(_ALLOCATIONS):
                    self._access(record, stream, use, written=True)
        return out

    def _operands(
        self, func: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
    ) -> Iterator[tuple[torch.Tensor, bool]]:
        """Each tensor the op takes, and whether it writes it (c10d ops: their first tensor
        argument, the collective's output or in-place buffer)."""
        collective = func.namespace == "c10d"
        first = True
        for index, arg in enumerate(func._schema.arguments):
            value = args[index] if index < len(args) else kwargs.get(arg.name)
            tensors = [t for t in _plain(tree_leaves(value)) if t.layout == torch.strided]
            if not tensors:
                continue
            written = (collective and first) or (arg.alias_info is not None and arg.alias_info.is_write)
            first = False
            for t in tensors:
                yield t, written

    def _access(self, record: _Storage, stream: CheckedStream, use: _Use, written: bool) -> None:
        earlier = [record.write] if record.write is not None else []
        if written:
            earlier += record.reads.values()
        for prior in earlier:
            if stream.ordered_after(prior):
                continue
            did = "wrote" if prior is record.write else "read"
            verb = "writes" if written else "reads"
            if stream.index == HOST:
                raise StreamRaceError(
                    f"{use.op} on the host {verb} {record.what}, which {prior.op} on stream "
                    f"'{self.streams[prior.stream].name}' {did}, before the host synchronized with "
                    "it (no event or stream synchronize after it)"
                )
            raise StreamRaceError(
                f"{use.op} on stream '{stream.name}' {verb} {record.what}, which {prior.op} on stream "
                f"'{self.streams[prior.stream].name}' {did}, with no wait or event in between"
            )
        if written:
            record.write = use
            record.reads = {}
        else:
            record.reads[stream.index] = use
        record.last_use[stream.index] = use
        if not record.host and stream.index not in (HOST, record.allocated_on):
            self._watched.add(record.ref.cdata)


def _plain(leaves: Sequence[object]) -> list[torch.Tensor]:
    """The plain tensors among ``leaves``, a tensor subclass that wraps others (a ``DTensor``)
    standing for the tensors it wraps (its local tensor): their storages are what the op uses."""
    out: list[torch.Tensor] = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            continue
        wrapper: object = leaf  # the TypeGuard makes a Tensor one unreachable to mypy
        if is_traceable_wrapper_subclass(wrapper):
            attrs, _ = wrapper.__tensor_flatten__()
            out += _plain([getattr(wrapper, a) for a in attrs])
        else:
            out.append(leaf)
    return out


class CheckedDevice:
    """``StreamChecker``'s streams and events as an accelerator ``Device``."""

    def __init__(self, checker: StreamChecker) -> None:
        self.checker = checker

    def current_stream(self) -> CheckedStream:
        return self.checker.current()

    def new_stream(self, name: str) -> CheckedStream:
        return self.checker.new_stream(name)

    def use_stream(self, stream: CheckedStream) -> contextlib.AbstractContextManager[object]:
        return self.checker.using(stream)

    def wait_stream(self, stream: CheckedStream, waits_for: CheckedStream) -> None:
        self.checker.wait_stream(stream, waits_for)

    def record_event(self, stream: CheckedStream) -> CheckedEvent:
        return self.checker.record_event(stream)

    def wait_event(self, stream: CheckedStream, event: CheckedEvent) -> None:
        self.checker.wait_event(stream, event)

    def host_wait(self, event: CheckedEvent) -> None:
        self.checker.host_wait(event)

    def synchronize(self, stream: CheckedStream) -> None:
        self.checker.synchronize(stream)

    def record_stream(self, tensor: torch.Tensor, stream: CheckedStream) -> None:
        self.checker.record_stream(tensor, stream)

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(numel, dtype=dtype)
        self.checker.mark_host(tensor)
        return tensor

    def holds(self, tensor: torch.Tensor) -> bool:
        return not self.checker.is_host(tensor)


@contextlib.contextmanager
def checked_streams() -> Iterator[StreamChecker]:
    """Inside: every FSDP tree built on the CPU runs the accelerator runtime on a checked device,
    and every op is checked; the checker is yielded (its ``ops_checked`` counts them)."""
    checker = StreamChecker()

    def runtime(groups: ProcessGroups, log: CollectiveLog) -> AcceleratorRuntime[CheckedStream, CheckedEvent]:
        checker.runtimes += 1
        return AcceleratorRuntime(groups, log, CheckedDevice(checker))

    set_cpu_runtime(runtime)
    try:
        with checker:
            yield checker
    finally:
        set_cpu_runtime(None)
