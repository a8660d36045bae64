"""What torch's optimizers hold per rank: their state, and what a step allocates for a moment.

FSDP hands the optimizer this rank's sharded parameters (``OptimizedTensor``: the flat shards,
or with ``use_orig_params`` each original parameter's sharded view that has a gradient). Their
memory follows from torch's implementations with their default arguments, as measured with
``fsdp_shell.memory.LiveBytes`` (``tests/shell/test_model_memory.py``):

- ``SGD``: no state, nothing allocated by a step.
- ``SGD`` with momentum: a momentum buffer per tensor, a copy of its first gradient (the
  gradient's dtype); a step allocates nothing more.
- ``Adam`` / ``AdamW`` (``weight_decay`` applied in place, as AdamW's is and Adam's default of 0
  needs none): ``exp_avg`` and ``exp_avg_sq`` per tensor in the parameter's dtype, and a
  ``step`` counter, a float32 scalar on the host unless the host is the device (then 4 bytes
  on it). A step's temporary is ``exp_avg_sq.sqrt() / bias_correction``: one tensor at a time
  (``foreach=False``, torch's default on the CPU), two of a tensor's size at once while the
  previous tensor's result is still held; or every tensor of one dtype at once
  (``foreach=True``, torch's default on CUDA), the previous dtype group's still held.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

import torch

from fsdp_core.memory.allocator import EXACT, Allocator
from fsdp_core.spec.config import parse_member

__all__ = ["OptimizedTensor", "OptimizerKind", "OptimizerSpec", "optimizer_state_bytes", "optimizer_step_bytes"]

STEP_COUNTER_BYTES = 4
"""Adam's ``step``: a float32 scalar tensor per parameter."""


class OptimizerKind(enum.Enum):
    """Which of torch's optimizers, with its default arguments (module docstring)."""

    SGD = "sgd"
    SGD_MOMENTUM = "sgd_momentum"
    ADAM = "adam"
    ADAMW = "adamw"

    @classmethod
    def parse(cls, name: str) -> OptimizerKind:
        """The member called ``name`` by value (``sgd``, ``sgd_momentum``/``sgd-momentum``, ``adam``,
        ``adamw``), or ``ValueError`` naming ``optimizer``."""
        return parse_member(cls, name, argument="optimizer", noun="optimizer", by_value=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSpec:
    """The optimizer, and whether its steps run ``foreach`` (torch's default: on CUDA yes, on the
    CPU no)."""

    kind: OptimizerKind = OptimizerKind.ADAMW
    foreach: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kind, OptimizerKind):
            raise TypeError(f"optimizer: expected an OptimizerKind, got {self.kind!r}")
        if not isinstance(self.foreach, bool):
            raise TypeError(f"foreach: expected a bool, got {self.foreach!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizedTensor:
    """One tensor the optimizer steps: its elements, its dtype and its gradient's dtype."""

    numel: int
    dtype: torch.dtype
    grad_dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.numel, int) or isinstance(self.numel, bool) or self.numel < 0:
            raise ValueError(f"numel: expected an int >= 0, got {self.numel!r}")

    @property
    def nbytes(self) -> int:
        """Bytes of a tensor like the parameter."""
        return self.numel * self.dtype.itemsize


def optimizer_state_bytes(
    spec: OptimizerSpec, tensors: Sequence[OptimizedTensor], *, host_is_device: bool, allocator: Allocator = EXACT
) -> int:
    """Device bytes of the state the optimizer keeps for ``tensors`` from its first step on.
    ``host_is_device``: the host's tensors count (the CPU runtime), so Adam's step counters do."""
    match spec.kind:
        case OptimizerKind.SGD:
            return 0
        case OptimizerKind.SGD_MOMENTUM:
            return sum(allocator.size(t.numel * t.grad_dtype.itemsize) for t in tensors)
        case OptimizerKind.ADAM | OptimizerKind.ADAMW:
            counter = allocator.size(STEP_COUNTER_BYTES) if host_is_device else 0
            return sum(2 * allocator.size(t.nbytes) + counter for t in tensors)
        case _:
            assert_never(spec.kind)


def optimizer_step_bytes(spec: OptimizerSpec, tensors: Sequence[OptimizedTensor], allocator: Allocator = EXACT) -> int:
    """The most bytes a step holds above the state for ``tensors`` (in the order the optimizer
    steps them) at any moment (module docstring)."""
    if spec.kind in (OptimizerKind.SGD, OptimizerKind.SGD_MOMENTUM):
        return 0
    if not spec.foreach:
        sizes = [allocator.size(t.nbytes) for t in tensors]
        return max((before + 2 * size for before, size in zip([0, *sizes], sizes)), default=0)
    groups: dict[torch.dtype, int] = {}
    for t in tensors:
        groups[t.dtype] = groups.get(t.dtype, 0) + allocator.size(t.nbytes)
    totals = list(groups.values())
    return max((before + now for before, now in zip([0, *totals], totals)), default=0)
