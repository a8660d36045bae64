"""Built-in communication hooks with FSDP1's ``default_hooks`` semantics, working on CPU too.

Each hook has FSDP1's signature ``hook(state, grad, output=None)``: with ``output`` it reduces
``grad`` over ``state.process_group`` and writes this rank's shard into ``output``; without, it
reduces ``grad`` in place. Each averages by FSDP1's split of the group size (divide by
``state.gradient_predivide_factor`` before, by ``state.gradient_postdivide_factor`` after).
PyTorch's own ``DefaultState`` works as ``state``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fsdp_core import CommHook, ShardingStrategy, fsdp1_predivide_factor
from fsdp_shell.runtime.collectives import all_reduce_flat, reduce_scatter_flat
from fsdp_shell.runtime.interpreter import CommHookFn

__all__ = [
    "DefaultState",
    "HookState",
    "allreduce_hook",
    "bf16_compress_hook",
    "bind",
    "builtin_kind",
    "fp16_compress_hook",
    "reduce_scatter_hook",
]


class HookState(Protocol):
    """What a hook's state must provide (PyTorch's ``DefaultState`` does)."""

    process_group: dist.ProcessGroup
    gradient_predivide_factor: float
    gradient_postdivide_factor: float


class DefaultState:
    """The group to reduce over and FSDP1's division split of its size."""

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        self.process_group = process_group
        size = process_group.size()
        self.world_size = size
        self.gradient_predivide_factor = float(fsdp1_predivide_factor(size))
        self.gradient_postdivide_factor = size / self.gradient_predivide_factor


def _reduce(state: HookState, grad: torch.Tensor, output: torch.Tensor | None) -> None:
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    if output is None:
        all_reduce_flat(grad, state.process_group)
        target = grad
    else:
        reduce_scatter_flat(output, grad, state.process_group)
        target = output
    if state.gradient_postdivide_factor > 1:
        target.div_(state.gradient_postdivide_factor)


def allreduce_hook(state: HookState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """All-reduce ``grad`` (averaging); with ``output``, keep this rank's chunk of it there."""
    _reduce(state, grad, None)
    if output is not None:
        rank, size = state.process_group.rank(), state.process_group.size()
        output.copy_(grad.chunk(size)[rank])


def reduce_scatter_hook(state: HookState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """Reduce-scatter ``grad`` into ``output`` (averaging); all-reduce in place without ``output``."""
    _reduce(state, grad, output)


def _compressed(state: HookState, grad: torch.Tensor, output: torch.Tensor | None, wire: torch.dtype) -> None:
    low = grad.to(wire)
    low_out = None if output is None else torch.empty_like(output, dtype=wire)
    _reduce(state, low, low_out)
    if output is None:
        grad.copy_(low)
    else:
        assert low_out is not None
        output.copy_(low_out)


def fp16_compress_hook(state: HookState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """Communicate in float16: cast, reduce (averaging), cast back into ``output`` or ``grad``."""
    _compressed(state, grad, output, torch.float16)


def bf16_compress_hook(state: HookState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """Communicate in bfloat16: cast, reduce (averaging), cast back into ``output`` or ``grad``."""
    _compressed(state, grad, output, torch.bfloat16)


def builtin_kind(hook: object) -> CommHook:
    """The plan's name for ``hook``: a built-in of this module, PyTorch's default hooks, or USER."""
    name = getattr(hook, "__name__", "")
    module = getattr(hook, "__module__", "") or ""
    ours = module == __name__ or module.endswith("default_hooks")
    kinds = {
        "allreduce_hook": CommHook.ALLREDUCE,
        "reduce_scatter_hook": CommHook.REDUCE_SCATTER,
        "fp16_compress_hook": CommHook.FP16_COMPRESS,
        "bf16_compress_hook": CommHook.BF16_COMPRESS,
    }
    return kinds.get(name, CommHook.USER) if ours else CommHook.USER


def bind(state: object, hook: Callable[..., Any], strategy: ShardingStrategy) -> tuple[CommHookFn, CommHook]:
    """``hook`` with its ``state``, as the plans call it (``hook(state, grad, output)`` for sharded
    strategies, ``hook(state, grad)`` otherwise), and its name in the plans. A hook that cannot
    take the call is refused now (``TypeError`` naming ``hook``) rather than half-way through a
    backward."""
    if not callable(hook):
        raise TypeError(f"hook: expected a callable, got {hook!r}")
    _check_signature(hook, state, strategy)

    def bound(grad: torch.Tensor, output: torch.Tensor | None) -> None:
        if output is None:
            hook(state, grad)
        else:
            hook(state, grad, output)

    return bound, builtin_kind(hook)


def _check_signature(hook: Callable[..., Any], state: object, strategy: ShardingStrategy) -> None:
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return
    args: tuple[object, ...] = (state, None, None) if strategy.is_sharded else (state, None)
    try:
        signature.bind(*args)
    except TypeError:
        wanted = "hook(state, grad, output)" if strategy.is_sharded else "hook(state, grad)"
        name = getattr(hook, "__name__", repr(hook))
        advice = (
            " (torch's allreduce_hook is for NO_SHARD; use reduce_scatter_hook)"
            if strategy.is_sharded and name == "allreduce_hook"
            else ""
        )
        raise TypeError(f"hook: {strategy.name} calls {wanted}, which {name}{signature} cannot take{advice}") from None
