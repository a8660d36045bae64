"""The forms gloo's collectives take on the CPU, and the sizes that choose them.

Gloo has no summing reduce-scatter of its own (torch emulates it with an all-reduce of a copy of
the input: twice the bytes, one more buffer). The CPU runtime reduce-scatters by all-to-all
into a receive buffer the size of the input and sums the chunks locally (the bytes of a ring
reduce-scatter, 4-8x faster on loopback: ``benchmarks/bench_collectives.py``), except where the
input is large and dies with the collective: then an in-place all-reduce of the input needs no
buffer beyond it, as the unsharded gradient dominates memory there.

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

from fsdp_core.spec.division import ReduceKind

__all__ = ["ALL_TO_ALL_MAX_BYTES", "ASYNC_GATHER_MAX_BYTES", "ScatterForm", "gather_waits", "scatter_form"]

ALL_TO_ALL_MAX_BYTES = 4 << 20
"""Summing reduce-scatters on gloo with inputs up to this size go by all-to-all into a receive
buffer; larger ones reduce their input in place when it dies with them."""

ASYNC_GATHER_MAX_BYTES = 4 << 20
"""On gloo, all-gathers with outputs up to this size stay in flight while the host goes on."""


class ScatterForm(enum.Enum):
    """How a reduce-scatter runs."""

    NATIVE = "native"
    """The backend's own reduce-scatter (any op but a sum on gloo)."""
    ALL_TO_ALL = "all_to_all"
    """All-to-all into a receive buffer the size of the input, then a local sum of the chunks."""
    ALL_REDUCE = "all_reduce"
    """An in-place all-reduce of the input, then a copy of this rank's chunk."""

    @property
    def receive_buffer(self) -> bool:
        """Whether it holds a receive buffer the size of its input while it runs."""
        return self is ScatterForm.ALL_TO_ALL


def scatter_form(kind: ReduceKind, src_bytes: int, *, gloo: bool, src_dies: bool) -> ScatterForm:
    """The form of a reduce-scatter of ``src_bytes`` with reduction ``kind``; ``src_dies``: no op
    after it uses its input before the plan frees it (``fsdp_core.plan.request.dies_after``)."""
    if not gloo or kind is not ReduceKind.SUM:
        return ScatterForm.NATIVE
    if src_dies and src_bytes > ALL_TO_ALL_MAX_BYTES:
        return ScatterForm.ALL_REDUCE
    return ScatterForm.ALL_TO_ALL


def gather_waits(output_bytes: int) -> bool:
    """Whether the host waits for a gloo all-gather of ``output_bytes`` before going on."""
    return output_bytes > ASYNC_GATHER_MAX_BYTES
