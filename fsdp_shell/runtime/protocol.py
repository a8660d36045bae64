"""The device seam: what the interpreter and the flat parameters ask of a device.

The interpreter (``fsdp_shell.runtime.interpreter``) turns each plan op into one call of a
``Runtime``; the flat parameters ask it for their all-gathers and host buffers. Nothing else in
the shell knows how a device orders work: ``CpuRuntime`` (``runtime.cpu``) runs it on the host
thread or on one lane thread, ``AcceleratorRuntime`` (``runtime.accelerator``) enqueues it on
device streams.
Every call names the plan stream the work belongs to and the tensors it reads or writes, so a
runtime can order it after what produces them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from fsdp_core import Group, ReduceOpSpec, Stream
from fsdp_shell.runtime.collectives import Pending, Waitable

__all__ = ["Runtime"]


class Runtime(Protocol):
    """Where a plan's ops and a unit's all-gathers run.

    ``uses`` are the tensors a piece of work reads or writes: a runtime that runs work out of
    program order (the CPU lane) orders it after every earlier work on those tensors and on its
    stream; a stream-ordered device needs only the stream."""

    frees_at_once: bool
    """Whether memory a free returns is free on the device when the call returns (the host runs
    the compute itself); where not, ``limit_all_gathers`` waits for ``free_marker``s."""

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device, stream: Stream) -> torch.Tensor:
        """A new 1-D buffer on ``device``, allocated for use on ``stream``."""

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer that device-to-host copies land in (pinned where that lets them run
        asynchronously)."""

    def free(self, tensor: torch.Tensor) -> None:
        """The plan is done with ``tensor`` (nothing else holds it): its memory goes back at this
        point of the program, or where work still in flight may use it, at the host's next wait
        for that work; never later because of another thread's timing. A stream-ordered device
        drops it (the caching allocator and ``record_stream`` keep it while streams use it)."""

    def begin_plan(self) -> None:
        """A unit's post-backward plan starts: where work runs out of program order, the work of
        plans more than ``PLANS_IN_FLIGHT`` before this one is waited for here and the memory
        they freed goes back."""

    def compute(self, stream: Stream, work: Callable[[], object], uses: tuple[torch.Tensor, ...]) -> None:
        """Run element-wise ``work`` in ``stream``'s order, after earlier work on ``uses``."""

    def on_host(self, work: Callable[[], None], uses: tuple[torch.Tensor, ...]) -> None:
        """Run ``work`` on the host thread once every earlier work on ``uses`` is done (it hands
        them to autograd or to the optimizer)."""

    def user_hook(self, stream: Stream, work: Callable[[], None], uses: tuple[torch.Tensor, ...]) -> None:
        """Run a user's hook on ``uses`` (FSDP2's all-reduce hook) in ``stream``'s order: on a
        device issued from the host thread with ``stream`` current, as FSDP2 does; on the CPU on
        the host thread once every earlier work on ``uses`` is done, so that the collectives it
        may issue on its own process groups come in program order."""

    def reduce_scatter(
        self, stream: Stream, group: Group, dst: torch.Tensor, src: torch.Tensor, op: ReduceOpSpec, *, src_dies: bool
    ) -> None:
        """Reduce ``src`` over ``group`` and leave this rank's chunk in ``dst``; ``src_dies``:
        nothing reads ``src`` afterwards, so the reduction may overwrite it."""

    def all_reduce(self, stream: Stream, group: Group, tensor: torch.Tensor, op: ReduceOpSpec) -> None:
        """Reduce ``tensor`` over ``group`` in place."""

    def comm_hook(
        self,
        stream: Stream,
        group: Group,
        call: Callable[[], None],
        src: torch.Tensor,
        out: torch.Tensor,
        wire_dtype: torch.dtype,
    ) -> None:
        """Run a communication hook (``call``) that reduces ``src`` over ``group`` into ``out``
        (``src`` itself when in place), communicating in ``wire_dtype``."""

    def to_host(self, stream: Stream, src: torch.Tensor, buffer: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``src``'s value on the host: ``src`` itself when it is there already, else copied
        (asynchronously where the device allows) into ``buffer()``; the end of backward waits
        for the copy."""

    def wait_stream(self, stream: Stream, waits_for: Stream) -> None:
        """``stream`` waits for the work enqueued on ``waits_for`` so far."""

    def end_of_backward(self, stream: Stream, waits_for: Stream) -> None:
        """At the end of backward: ``stream``, and the host where results go to the host, wait
        for everything on ``waits_for``."""

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``tensor`` is in use on ``stream``: its memory is not handed out again until
        ``stream``'s work so far is done (the caching allocator's bookkeeping)."""

    def drain(self) -> None:
        """Block until all work issued so far has completed; raise what failed out of order."""

    def settle(self) -> None:
        """Where work runs out of program order on the host (the CPU lane): block until it has
        run and raise what failed. A device whose streams order its work returns at once: the
        plans' waits order it for the device, and the host does not wait for the device (only
        for host copies, at the end of backward)."""

    def free_marker(self) -> Waitable:
        """A point after the compute stream's work enqueued so far: its ``wait`` blocks the host
        until that work has run, so memory freed before the call is free on the device
        (``limit_all_gathers``). Asked only where frees are not at once (``frees_at_once``)."""

    def all_gather(self, out: torch.Tensor, src: torch.Tensor) -> Pending | None:
        """Issue the all-gather of every shard-group rank's ``src`` into ``out`` (a unit's
        unsharded flat parameter); None when it has landed already. ``src`` may be ``out``'s own
        chunk (an in-place all-gather)."""
