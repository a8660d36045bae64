"""The plan language: named buffers, named streams and groups, and a closed union of ops.

Ops hold only ints, strings, tuples, dtypes and enums. Process groups and streams are named by
enum and resolved by whoever runs the plan. Every op is a frozen, slotted dataclass, so a plan
is a hashable value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union, assert_never

import torch

from fsdp_core.spec.config import CommHook
from fsdp_core.spec.division import ReduceOpSpec
from fsdp_core.spec.layout import ShardView
from fsdp_core.spec.per_param import PerParamLayout

__all__ = [
    "Accumulate",
    "AllReduce",
    "AllReduceHookCall",
    "Buffer",
    "Cast",
    "CommHookCall",
    "CopyIn",
    "Destination",
    "Device",
    "Divide",
    "EndOfBackwardWait",
    "Free",
    "FreeUnshardedParam",
    "GradViews",
    "Group",
    "HandOff",
    "Input",
    "InputRole",
    "Offload",
    "Op",
    "Pad",
    "RecordStream",
    "ReduceScatter",
    "Stream",
    "WaitStream",
]


class Stream(enum.Enum):
    """Named execution streams; the shell maps them to CUDA streams, or to ordered CPU queues."""

    COMPUTE = "compute"
    """The default stream: forward, backward, optimizer."""
    POST_BACKWARD = "post_backward"
    """FSDP's post-backward stream: casts, reduce-scatter, post-processing."""
    ALL_REDUCE = "all_reduce"
    """The hybrid replicate all-reduce and what follows it, overlapping later reduce-scatters."""
    ALL_GATHER = "all_gather"
    """FSDP's unshard stream: all-gathers of flat parameters (CUDA: a stream of its own; CPU:
    asynchronous gloo work). Post-backward plans do not use it; the all-gather schedule
    (``fsdp_core.unshard.schedule``) does."""


class Group(enum.Enum):
    """Named process groups."""

    SHARD = "shard"
    """FSDP's process group: the shard group for hybrid strategies, the whole data-parallel
    group otherwise (for ``NO_SHARD`` the group its all-reduce runs over)."""
    REPLICATE = "replicate"
    """The replicate group of hybrid strategies."""


class Device(enum.Enum):
    """Where a buffer's memory lives."""

    DEVICE = "device"
    """The compute device (a GPU, or the CPU when there is no accelerator)."""
    HOST = "host"
    """CPU memory used for offloading."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Buffer:
    """A named one-dimensional buffer."""

    name: str
    numel: int
    dtype: torch.dtype
    device: Device = Device.DEVICE

    def __str__(self) -> str:
        match self.device:
            case Device.DEVICE:
                where = ""
            case Device.HOST:
                where = "@host"
            case _:
                assert_never(self.device)
        return f"{self.name}[{self.numel}:{_short(self.dtype)}{where}]"

    @property
    def nbytes(self) -> int:
        """Bytes the buffer occupies."""
        return self.numel * self.dtype.itemsize


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class InputRole(enum.Enum):
    """What a buffer present at the start of the plan holds."""

    GRAD = "grad"
    """The unsharded gradient autograd just produced for the flat parameter."""
    PENDING_UNSHARDED = "pending_unsharded"
    """An unsharded gradient accumulated by earlier ``no_sync`` backwards."""
    SHARDED_GRAD = "sharded_grad"
    """A reduced sharded gradient from an earlier backward, to accumulate into."""
    PENDING_PARTIAL = "pending_partial"
    """A shard-group-reduced gradient whose replicate all-reduce was deferred."""


class Destination(enum.Enum):
    """Where the plan leaves the gradient for the optimizer."""

    SHARDED_GRAD = "sharded_grad"
    """The flat parameter's ``.grad`` becomes this rank's reduced shard."""
    ACCUMULATED_GRAD = "accumulated_grad"
    """The existing sharded gradient, with this backward's shard added in."""
    CPU_GRAD = "cpu_grad"
    """The flat parameter's ``.grad`` is the offloaded CPU gradient."""
    UNSHARDED_GRAD = "unsharded_grad"
    """Inside ``no_sync``: the unsharded gradient stays on the flat parameter, unreduced."""
    PARTIAL = "partial"
    """Hybrid with the all-reduce deferred: the partial reduction is kept for a later backward."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Input:
    """``buffer`` exists at the start of the plan, last written on ``stream``."""

    buffer: Buffer
    role: InputRole
    stream: Stream = Stream.COMPUTE


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitStream:
    """``stream`` waits for all work enqueued on ``waits_for`` so far."""

    stream: Stream
    waits_for: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordStream:
    """Tell the caching allocator ``buffer`` is in use on ``stream`` (``Tensor.record_stream``):
    its memory is not reused until ``stream``'s work enqueued so far has finished."""

    buffer: Buffer
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class Free:
    """Drop the last reference to ``buffer``; its memory returns to the pool of the stream that
    allocated it, for reuse by work enqueued there later."""

    buffer: Buffer
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class FreeUnshardedParam:
    """Reshard: free the unsharded parameters (FSDP1's ``_should_free_in_backward``; a
    per-parameter unit's ``reshard_after_backward``)."""

    stream: Stream = Stream.COMPUTE


@dataclass(frozen=True, slots=True, kw_only=True)
class Cast:
    """``dst = src.to(dst.dtype)``; allocates ``dst``."""

    src: Buffer
    dst: Buffer
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class Pad:
    """``dst = cat(src, zeros(dst.numel - src.numel))``; allocates ``dst``."""

    src: Buffer
    dst: Buffer
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyIn:
    """A per-parameter unit's reduce-scatter copy-in (PyTorch's ``chunk_cat``): ``src`` holds the
    unit's unsharded gradients (one tensor per parameter, ``layout.total_numel`` elements in
    all); each is padded on its shard dimension to ``layout.world`` chunks and chunk ``r`` of every
    parameter goes to rank ``r``'s slice of ``dst`` (``layout.chunk_at``), cast to ``dst``'s
    dtype, the padding zero. Allocates ``dst`` (``layout.padded_numel`` elements)."""

    src: Buffer
    dst: Buffer
    layout: PerParamLayout
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class Divide:
    """``buffer /= factor`` in place."""

    buffer: Buffer
    factor: float
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class ReduceScatter:
    """``dst = reduce_op(src over group)[rank-th chunk]``; allocates ``dst``.
    ``src.numel == dst.numel * group size``; both have one dtype."""

    src: Buffer
    dst: Buffer
    group: Group
    reduce_op: ReduceOpSpec
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class AllReduce:
    """``buffer = reduce_op(buffer over group)`` in place."""

    buffer: Buffer
    group: Group
    reduce_op: ReduceOpSpec
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class AllReduceHookCall:
    """Call the unit's all-reduce hook (FSDP2's ``set_all_reduce_hook``) on ``buffer`` in place:
    the reduced gradient in the reduce dtype, after the reductions and the division. The hook
    may communicate over process groups of its own, which the plan does not see."""

    buffer: Buffer
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class CommHookCall:
    """Call the registered communication hook: ``hook(state, src, dst)``, or ``hook(state, src)``
    in place when ``dst`` is ``src`` (``NO_SHARD``). The hook reduces over ``group`` and divides
    by ``divides_by`` (its state's group size), communicating in ``wire_dtype``; it allocates
    ``dst`` when that differs from ``src``."""

    hook: CommHook
    src: Buffer
    dst: Buffer
    group: Group
    divides_by: int
    wire_dtype: torch.dtype
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class Accumulate:
    """``dst += src`` in place (``dst`` already exists; its dtype is ``src``'s or wider, as a
    per-parameter unit's reduce-dtype accumulation of lower-precision gradients)."""

    dst: Buffer
    src: Buffer
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class Offload:
    """Copy ``src`` into the host buffer ``dst`` (non-blocking device-to-host copy); with
    ``accumulate`` add into the existing ``dst`` instead. Allocates ``dst`` unless accumulating."""

    src: Buffer
    dst: Buffer
    accumulate: bool
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class GradViews:
    """Expose ``views`` of ``buffer`` as the original parameters' ``.grad`` (``use_orig_params``)."""

    buffer: Buffer
    views: tuple[ShardView, ...]
    stream: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class EndOfBackwardWait:
    """Deferred to the end of backward (FSDP1's final callback): ``stream`` waits for ``waits_for``.
    This op and every op after it run once the whole backward has been enqueued."""

    stream: Stream
    waits_for: Stream


@dataclass(frozen=True, slots=True, kw_only=True)
class HandOff:
    """The gradient the optimizer will see: ``buffer`` at ``destination``, on ``stream``."""

    buffer: Buffer
    destination: Destination
    stream: Stream = Stream.COMPUTE


Op = Union[
    Input,
    WaitStream,
    RecordStream,
    Free,
    FreeUnshardedParam,
    Cast,
    Pad,
    CopyIn,
    Divide,
    ReduceScatter,
    AllReduce,
    AllReduceHookCall,
    CommHookCall,
    Accumulate,
    Offload,
    GradViews,
    EndOfBackwardWait,
    HandOff,
]
"""The closed union of plan ops. Every consumer ``match``es on it and ends with
``case _: assert_never(op)``, so mypy rejects a new op kind wherever it is not handled."""


def op_name(op: Op) -> str:
    """The snake_case name of an op's kind (``reduce_scatter``, ``all_reduce``...)."""
    match op:
        case Input():
            return "input"
        case WaitStream():
            return "wait_stream"
        case RecordStream():
            return "record_stream"
        case Free():
            return "free"
        case FreeUnshardedParam():
            return "free_unsharded_param"
        case Cast():
            return "cast"
        case Pad():
            return "pad"
        case CopyIn():
            return "copy_in"
        case Divide():
            return "divide"
        case ReduceScatter():
            return "reduce_scatter"
        case AllReduce():
            return "all_reduce"
        case AllReduceHookCall():
            return "all_reduce_hook"
        case CommHookCall():
            return "comm_hook"
        case Accumulate():
            return "accumulate"
        case Offload():
            return "offload"
        case GradViews():
            return "grad_views"
        case EndOfBackwardWait():
            return "end_of_backward_wait"
        case HandOff():
            return "hand_off"
        case _:
            assert_never(op)
