"""A module's states before they are flattened: materialized from the meta device, and
broadcast from rank 0 (FSDP1's ``param_init_fn`` and ``sync_module_states``).

A model too large for one host is built under ``torch.device("meta")``. ``materialize`` gives
each of its modules real storage, as FSDP1 does: with ``param_init_fn``, by calling it on every
module that is not already an FSDP tree of its own, breadth-first; without one, every module
that holds a meta parameter or buffer of its own is moved with ``to_empty(recurse=False)`` and
initialized with its ``reset_parameters()``; parameters registered under several names (tied
weights) are tied again afterwards. ``broadcast_states`` copies rank 0's parameters
and buffers to every rank of the groups, so a model loaded on rank 0 alone (the others built on
meta) starts the same everywhere. ``cast_buffers`` keeps floating-point buffers in
``MixedPrecision.buffer_dtype``, as FSDP1 does from the first forward on.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fsdp_shell.runtime.collectives import broadcast_flat

__all__ = ["broadcast_states", "cast_buffers", "materialize", "move_states"]


def _modules(root: nn.Module, is_wrapped: Callable[[nn.Module], bool]) -> Iterator[nn.Module]:
    """``root`` and its descendants breadth-first, not entering already-wrapped trees."""
    queue: deque[nn.Module] = deque([root])
    while queue:
        m = queue.popleft()
        yield m
        queue.extend(c for c in m.children() if not is_wrapped(c))


def _own_states(m: nn.Module) -> Iterator[torch.Tensor]:
    return itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False))


def materialize(
    root: nn.Module,
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
    is_wrapped: Callable[[nn.Module], bool],
) -> None:
    """Give every meta parameter and buffer of ``root`` real storage on ``device`` (see the
    module docstring); a no-op when none is on the meta device. ``ValueError`` naming the
    module that has meta states but no ``reset_parameters`` (and no ``param_init_fn``), or that
    ``param_init_fn`` left on the meta device."""
    modules = list(_modules(root, is_wrapped))
    names = {id(m): name or "the root module" for name, m in root.named_modules()}
    if not any(t.is_meta for m in modules for t in _own_states(m)):
        return
    tied = _shared_slots(modules)
    for m in modules:
        if param_init_fn is not None:
            param_init_fn(m)
            continue
        if not any(t.is_meta for t in _own_states(m)):
            continue
        reset = getattr(m, "reset_parameters", None)
        if not callable(reset):
            raise ValueError(
                f"module: {names[id(m)]} ({type(m).__name__}) is on the meta device and has no "
                "reset_parameters() to initialize it; pass param_init_fn=, or build it on a real device"
            )
        m.to_empty(device=device, recurse=False)
        with torch.no_grad():
            reset()
    for (first, first_attr), *others in tied:
        kept = first._parameters[first_attr]
        for m, attr in others:
            m._parameters[attr] = kept
    left = sorted(names[id(m)] for m in modules if any(t.is_meta for t in _own_states(m)))
    if left:
        raise ValueError(f"param_init_fn: left these modules on the meta device: {', '.join(left)}")


def move_states(root: nn.Module, device: torch.device, is_wrapped: Callable[[nn.Module], bool]) -> None:
    """Every parameter and buffer of ``root`` outside already-wrapped (and ignored) modules on
    ``device``, as ``root.to(device)`` would put them."""
    for m in _modules(root, is_wrapped):
        m._apply(lambda t: t.to(device), recurse=False)  # type: ignore[no-untyped-call]  # nn.Module._apply is unannotated


def _shared_slots(modules: list[nn.Module]) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter registered more than once (tied weights), as its ``(module, attribute)``
    slots, first registration first: materializing module by module gives each slot a tensor of
    its own, so ``materialize`` ties them again."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in modules:
        for attr, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((m, attr))
    return [s for s in slots.values() if len(s) > 1]


def broadcast_states(
    root: nn.Module,
    groups: tuple[dist.ProcessGroup, ...],
    is_wrapped: Callable[[nn.Module], bool],
    ignored: frozenset[int] = frozenset(),
) -> None:
    """Every parameter and buffer of ``root`` (outside already-wrapped or ignored modules, and
    but the ``ignored`` parameters) becomes rank 0's of each group in turn: the shard group, then
    for hybrid strategies the replicate group."""
    seen: set[int] = set(ignored)
    states = []
    for m in _modules(root, is_wrapped):
        for t in _own_states(m):
            if id(t) not in seen:
                seen.add(id(t))
                states.append(t)
    for group in groups:
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for t in states:
                broadcast_flat(t.data, src, group)


def cast_buffers(root: nn.Module, dtype: torch.dtype | None, is_wrapped: Callable[[nn.Module], bool]) -> None:
    """Every floating-point buffer of ``root`` (outside already-wrapped trees, non-persistent
    ones too) in ``dtype``; nothing for None."""
    if dtype is None:
        return
    for m in _modules(root, is_wrapped):
        for buf in m.buffers(recurse=False):
            if torch.is_floating_point(buf) and buf.dtype != dtype:
                buf.data = buf.data.to(dtype)
