"""The CUDA runtime: every op enqueued from the hook on the CUDA stream its plan stream maps to.

Waits are ``wait_stream``; ``record_stream`` tells the caching allocator; device-to-host copies
are non-blocking into pinned host buffers, and the end of backward waits for them on the host;
a unit's all-gather runs on the all-gather stream, which first waits for the current stream, so
it overlaps compute, and the compute stream waits for it when the parameter is used. Nothing
here has run on a GPU yet; ``tests/test_gpu.py`` and ``scripts/gpu_check.sh`` are for the day one
is lent.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import torch
import torch.distributed as dist

from fsdp_core import Group, ReduceOpSpec, Stream
from fsdp_shell.runtime.collectives import all_gather_flat, reduce_scatter_flat, to_reduce_op
from fsdp_shell.runtime.groups import ProcessGroups
from fsdp_shell.runtime.log import CollectiveLog
from fsdp_shell.runtime.protocol import Pending

__all__ = ["CudaRuntime"]


class CudaRuntime:
    """The plan streams as CUDA streams of ``device``: ``COMPUTE`` is the current stream there,
    every other plan stream a stream of its own."""

    def __init__(self, groups: ProcessGroups, log: CollectiveLog, device: torch.device) -> None:
        self._groups = groups
        self._log = log
        with torch.cuda.device(device):
            streams: dict[Stream, torch.cuda.Stream] = {Stream.COMPUTE: torch.cuda.current_stream()}
            for s in Stream:
                if s is not Stream.COMPUTE:
                    streams[s] = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch.cuda.Stream is unannotated
        self.streams = MappingProxyType(streams)
        self._host_copies: list[torch.cuda.Event] = []

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device, stream: Stream) -> torch.Tensor:
        with torch.cuda.stream(self.streams[stream]):
            return torch.empty(numel, dtype=dtype, device=device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def compute(self, stream: Stream, work: Callable[[], object], uses: tuple[torch.Tensor, ...]) -> None:
        with torch.cuda.stream(self.streams[stream]):
            work()

    def on_host(self, work: Callable[[], None], uses: tuple[torch.Tensor, ...]) -> None:
        work()

    def reduce_scatter(
        self, stream: Stream, group: Group, dst: torch.Tensor, src: torch.Tensor, op: ReduceOpSpec, *, src_dies: bool
    ) -> None:
        pg = self._groups.of(group)
        with torch.cuda.stream(self.streams[stream]):
            self._log.add("reduce_scatter", group, src.dtype, src.numel())
            work = reduce_scatter_flat(dst, src, pg, to_reduce_op(op), async_op=True)
            if work is not None:
                Pending(work, (src, dst)).wait()

    def all_reduce(self, stream: Stream, group: Group, tensor: torch.Tensor, op: ReduceOpSpec) -> None:
        pg = self._groups.of(group)
        with torch.cuda.stream(self.streams[stream]):
            self._log.add("all_reduce", group, tensor.dtype, tensor.numel())
            work = dist.all_reduce(tensor, op=to_reduce_op(op), group=pg, async_op=True)
            if work is not None:
                Pending(work, (tensor,)).wait()

    def comm_hook(
        self,
        stream: Stream,
        group: Group,
        call: Callable[[], None],
        src: torch.Tensor,
        out: torch.Tensor,
        wire_dtype: torch.dtype,
    ) -> None:
        with torch.cuda.stream(self.streams[stream]):
            self._log.add("comm_hook", group, wire_dtype, src.numel())
            call()

    def to_host(self, stream: Stream, src: torch.Tensor, buffer: Callable[[], torch.Tensor]) -> torch.Tensor:
        if not src.is_cuda:
            return src
        dst = buffer()
        s = self.streams[stream]
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        event.record(s)
        self._host_copies.append(event)
        return dst

    def wait_stream(self, stream: Stream, waits_for: Stream) -> None:
        self.streams[stream].wait_stream(self.streams[waits_for])

    def end_of_backward(self, stream: Stream, waits_for: Stream) -> None:
        self.wait_stream(stream, waits_for)
        copies, self._host_copies = self._host_copies, []
        for event in copies:
            event.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        if tensor.is_cuda:
            tensor.record_stream(self.streams[stream])

    def drain(self) -> None:
        for s in self.streams.values():
            s.synchronize()

    def all_gather(self, out: torch.Tensor, src: torch.Tensor) -> Pending | None:
        gather = self.streams[Stream.ALL_GATHER]
        gather.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(gather):
            self._log.add("all_gather", Group.SHARD, out.dtype, out.numel())
            work = all_gather_flat(out, src, self._groups.gather_group, async_op=True)
        src.record_stream(gather)
        return None if work is None else Pending(work, (src, out))
