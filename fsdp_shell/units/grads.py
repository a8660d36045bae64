"""What a plan buffer is bound to when a plan runs: one tensor, or a per-parameter unit's
unsharded gradients, one tensor per parameter (the interpreter, the units that own plans and the
simulated world share these, and ``fsdp-plan`` loads them without the runtime)."""

from __future__ import annotations

import torch

__all__ = ["Grads", "one_tensor", "parts"]

Grads = torch.Tensor | tuple[torch.Tensor, ...]
"""What a plan buffer is bound to: one tensor, or a per-parameter unit's unsharded gradients (one
tensor per parameter, in the layout's order)."""


def parts(value: Grads) -> tuple[torch.Tensor, ...]:
    """The tensors ``value`` is made of (itself alone when it is one tensor)."""
    return value if isinstance(value, tuple) else (value,)


def one_tensor(value: Grads, what: str) -> torch.Tensor:
    """``value`` when it is one tensor; a flat parameter's buffers and every reduced gradient are."""
    if isinstance(value, tuple):
        raise TypeError(f"{what}: expected one tensor, got a per-parameter unit's {len(value)} gradients")
    return value
