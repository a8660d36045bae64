"""The accelerator runtime: every op enqueued from the hook on the device stream its plan stream
maps to, written once against a ``Device`` (streams, events, the caching allocator's
``record_stream``, pinned host memory).

``TorchDevice`` is any accelerator PyTorch supports, through its device-agnostic API
(``torch.Stream``, ``torch.Event``, ``torch.accelerator``), as FSDP2's ``_get_device_handle``
does: CUDA, and XPU, MPS, HPU or a PrivateUse1 backend alike. The test suite runs the same
runtime on a checked-streams device (``tests/device/checked_streams.py``) that executes on CPU tensors
and raises on every cross-stream use that is neither waited for nor recorded.

Ordering, as the runtime expresses it to the device:

- a collective is issued synchronously inside its stream: the stream waits for it (on NCCL the
  host does not), so every later op on that stream sees its result;
- a stream that reads what another produced first waits for it (the plan's ``WaitStream``);
- a tensor used on a stream other than the one it was allocated on, and freed before that
  stream's work is known done, is recorded there (the plan's ``RecordStream``);
- a unit's all-gather runs on the all-gather stream, which first waits for the current stream;
  an event recorded after it is what the current stream waits for when the parameter is used;
- device-to-host copies are non-blocking into pinned buffers; an event after each is what the
  host waits for at the end of backward, before the optimizer reads them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import Generic, Protocol, TypeVar

import torch

from fsdp_core import Group, ReduceOpSpec, Stream
from fsdp_shell.runtime.collectives import (
    CollectiveLog,
    Pending,
    Waitable,
    all_gather_flat,
    all_reduce_flat,
    reduce_scatter_flat,
    to_reduce_op,
)
from fsdp_shell.runtime.groups import ProcessGroups

__all__ = ["AcceleratorRuntime", "Device", "TorchDevice"]

S = TypeVar("S")
E = TypeVar("E")


class Device(Protocol[S, E]):
    """What the accelerator runtime asks of a device, with its streams ``S`` and events ``E``
    opaque: the runtime only passes them back."""

    def current_stream(self) -> S:
        """The stream work is enqueued on now (autograd's, outside any ``use_stream``)."""

    def new_stream(self, name: str) -> S:
        """A stream of its own (``name`` is for diagnostics)."""

    def use_stream(self, stream: S) -> contextlib.AbstractContextManager[object]:
        """Make ``stream`` the current stream inside the block."""

    def wait_stream(self, stream: S, waits_for: S) -> None:
        """``stream``'s later work waits for the work enqueued on ``waits_for`` so far."""

    def record_event(self, stream: S) -> E:
        """An event that completes when ``stream``'s work so far has."""

    def wait_event(self, stream: S, event: E) -> None:
        """``stream``'s later work waits for ``event``."""

    def host_wait(self, event: E) -> None:
        """Block the host until ``event`` has completed."""

    def synchronize(self, stream: S) -> None:
        """Block the host until ``stream``'s work so far has completed."""

    def record_stream(self, tensor: torch.Tensor, stream: S) -> None:
        """``tensor``'s memory is not handed out again until ``stream``'s work so far is done."""

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A page-locked host buffer, so device-to-host copies into it run asynchronously."""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this device (not on the host)."""


class TorchDevice:  # pragma: no cover  (needs an accelerator; docs/design.md lists what only one runs)
    """A PyTorch accelerator through ``torch.Stream``, ``torch.Event`` and ``torch.accelerator``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_stream(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def new_stream(self, name: str) -> torch.Stream:
        return torch.Stream(device=self.device)

    def use_stream(self, stream: torch.Stream) -> contextlib.AbstractContextManager[object]:
        return stream

    def wait_stream(self, stream: torch.Stream, waits_for: torch.Stream) -> None:
        stream.wait_stream(waits_for)

    def record_event(self, stream: torch.Stream) -> torch.Event:
        event = torch.Event(device=self.device)
        event.record(stream)
        return event

    def wait_event(self, stream: torch.Stream, event: torch.Event) -> None:
        stream.wait_event(event)

    def host_wait(self, event: torch.Event) -> None:
        event.synchronize()

    def synchronize(self, stream: torch.Stream) -> None:
        stream.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: torch.Stream) -> None:
        tensor.record_stream(stream)

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device.type


class _EventWait(Generic[S, E]):
    """A collective issued on a side stream, as a ``Pending``'s work: ``wait`` makes the current
    stream wait for the event recorded after it (the host does not block)."""

    def __init__(self, device: Device[S, E], event: E) -> None:
        self._device = device
        self._event = event

    def wait(self) -> bool:
        self._device.wait_event(self._device.current_stream(), self._event)
        return True


class _HostWait(Generic[S, E]):
    """An event the host waits for (``Runtime.free_marker``)."""

    def __init__(self, device: Device[S, E], event: E) -> None:
        self._device = device
        self._event = event

    def wait(self) -> None:
        self._device.host_wait(self._event)


class AcceleratorRuntime(Generic[S, E]):
    """The plan streams as streams of ``device``: ``COMPUTE`` is the current stream at
    construction (autograd's), every other plan stream a stream of its own."""

    frees_at_once = False

    def __init__(self, groups: ProcessGroups, log: CollectiveLog, device: Device[S, E]) -> None:
        self._groups = groups
        self._log = log
        self._device = device
        streams: dict[Stream, S] = {Stream.COMPUTE: device.current_stream()}
        for s in Stream:
            if s is not Stream.COMPUTE:
                streams[s] = device.new_stream(s.value)
        self.streams = MappingProxyType(streams)
        self._host_copies: list[E] = []

    @contextlib.contextmanager
    def _on(self, stream: Stream) -> Iterator[None]:
        with self._device.use_stream(self.streams[stream]):
            yield

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device, stream: Stream) -> torch.Tensor:
        with self._on(stream):
            return torch.empty(numel, dtype=dtype, device=device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._device.pinned_empty(numel, dtype)

    def free(self, tensor: torch.Tensor) -> None:
        return None

    def begin_plan(self) -> None:
        return None

    def compute(self, stream: Stream, work: Callable[[], object], uses: tuple[torch.Tensor, ...]) -> None:
        with self._on(stream):
            work()

    def on_host(self, work: Callable[[], None], uses: tuple[torch.Tensor, ...]) -> None:
        work()

    def user_hook(self, stream: Stream, work: Callable[[], None], uses: tuple[torch.Tensor, ...]) -> None:
        with self._on(stream):
            work()

    def reduce_scatter(
        self, stream: Stream, group: Group, dst: torch.Tensor, src: torch.Tensor, op: ReduceOpSpec, *, src_dies: bool
    ) -> None:
        pg = self._groups.of(group)
        with self._on(stream):
            self._log.add("reduce_scatter", group, src.dtype, src.numel())
            reduce_scatter_flat(dst, src, pg, to_reduce_op(op))

    def all_reduce(self, stream: Stream, group: Group, tensor: torch.Tensor, op: ReduceOpSpec) -> None:
        pg = self._groups.of(group)
        with self._on(stream):
            self._log.add("all_reduce", group, tensor.dtype, tensor.numel())
            all_reduce_flat(tensor, pg, to_reduce_op(op))

    def comm_hook(
        self,
        stream: Stream,
        group: Group,
        call: Callable[[], None],
        src: torch.Tensor,
        out: torch.Tensor,
        wire_dtype: torch.dtype,
    ) -> None:
        with self._on(stream):
            self._log.add("comm_hook", group, wire_dtype, src.numel())
            call()

    def to_host(self, stream: Stream, src: torch.Tensor, buffer: Callable[[], torch.Tensor]) -> torch.Tensor:
        if not self._device.holds(src):
            return src
        dst = buffer()
        with self._on(stream):
            dst.copy_(src, non_blocking=True)
        self._host_copies.append(self._device.record_event(self.streams[stream]))
        return dst

    def wait_stream(self, stream: Stream, waits_for: Stream) -> None:
        self._device.wait_stream(self.streams[stream], self.streams[waits_for])

    def end_of_backward(self, stream: Stream, waits_for: Stream) -> None:
        self.wait_stream(stream, waits_for)
        copies, self._host_copies = self._host_copies, []
        for event in copies:
            self._device.host_wait(event)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        if self._device.holds(tensor):
            self._device.record_stream(tensor, self.streams[stream])

    def drain(self) -> None:
        for s in self.streams.values():
            self._device.synchronize(s)

    def settle(self) -> None:
        pass

    def free_marker(self) -> Waitable:
        return _HostWait(self._device, self._device.record_event(self._device.current_stream()))

    def all_gather(self, out: torch.Tensor, src: torch.Tensor) -> Pending | None:
        device = self._device
        gather = self.streams[Stream.ALL_GATHER]
        device.wait_stream(gather, device.current_stream())
        with device.use_stream(gather):
            self._log.add("all_gather", Group.SHARD, out.dtype, out.numel())
            all_gather_flat(out, src, self._groups.gather_group)
        device.record_stream(src, gather)
        return Pending(_EventWait(device, device.record_event(gather)), (src, out))
