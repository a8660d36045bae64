"""Gradient lifetimes, measured inside a gloo world: weak references on every unit's unsharded
autograd gradient, and on the original parameters, show when each is released.
"""

from __future__ import annotations

import gc
import time
import weakref
from dataclasses import dataclass, field

import torch

from fsdp_core import ShardingStrategy
from fsdp_shell import FSDP
from fsdp_shell.units.flat_param import FlatParamHandle
from tests.worlds.runtime_cases import Layer, batch, make_model

# -- gradient lifetimes ---------------------------------------------------------------------


@dataclass
class Lifetimes:
    """What one rank saw of the unsharded gradients' and original parameters' lifetimes."""

    alive_at_later_hooks: list[str] = field(default_factory=list)
    """Gradients still referenced at a later hook although they should be gone: this step's
    earlier units' (sharded strategies: reduced into a new shard), and every earlier step's
    (after ``zero_grad`` and the next forward)."""
    alive_after_backward: list[str] = field(default_factory=list)
    originals_alive: int = 0
    """Original parameter objects still alive after wrapping (``use_orig_params=False``)."""
    originals_not_shard_views: int = 0
    """Original parameters (``use_orig_params=True``) whose storage is not the local shard's."""
    checked: int = 0


def _still_alive(grads: list[tuple[str, weakref.ref[torch.Tensor]]]) -> list[str]:
    """The names whose tensors outlive a short grace period: a gloo worker thread drops its
    reference to a finished collective's tensors just after ``wait()`` returns."""
    deadline = time.monotonic() + 0.5
    while True:
        alive = [n for n, r in grads if r() is not None]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.001)


def grad_lifetimes(rank: int, world: int, arg: None) -> dict[str, Lifetimes]:
    """Per strategy and ``use_orig_params``: weakrefs on every unit's autograd gradient must be
    dead once it should be released."""
    out = {}
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        for orig in (False, True):
            out[f"{strategy.name}-orig{orig}"] = _lifetimes(strategy, orig)
    return out


def _lifetimes(strategy: ShardingStrategy, orig: bool) -> Lifetimes:
    """Sharded strategies release a unit's unsharded gradient once its reduction has completed.
    NO_SHARD hands the all-reduced autograd gradient itself to the optimizer, so only
    ``zero_grad`` (and, with ``use_orig_params``, the next forward, as in FSDP1) releases it."""
    seen = Lifetimes()
    module = make_model(32, 4)
    originals = [weakref.ref(p) for p in module.parameters()]
    model = FSDP(module, sharding_strategy=strategy, auto_wrap_policy={Layer}, use_orig_params=orig)
    del module
    gc.collect()
    if orig:
        shards = {h.local.untyped_storage().data_ptr() for h in model._flat_handles()}
        seen.originals_not_shard_views = sum(
            p.untyped_storage().data_ptr() not in shards for p in model.parameters() if p.numel()
        )
    else:
        seen.originals_alive = sum(r() is not None for r in originals)
    runtime = model._tree.runtime
    earlier: list[tuple[str, weakref.ref[torch.Tensor]]] = []
    this_step: list[tuple[str, weakref.ref[torch.Tensor]]] = []

    def watch(name: str, handle: FlatParamHandle) -> None:
        take = handle.take_grad

        def take_and_check() -> torch.Tensor:
            runtime.drain()
            seen.alive_at_later_hooks.extend(_still_alive(earlier + (this_step if strategy.is_sharded else [])))
            seen.checked += 1
            g = take()
            this_step.append((name, weakref.ref(g)))
            return g

        handle.take_grad = take_and_check  # type: ignore[method-assign]  # test-only instrumentation

    for i, h in enumerate(model._flat_handles()):
        watch(f"unit{i}", h)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = batch(step, 4)
        ((model(x) - y) ** 2).mean().backward()
        if strategy.is_sharded:
            seen.alive_after_backward.extend(_still_alive(this_step))
        opt.step()
        opt.zero_grad()
        earlier += this_step
        this_step.clear()
    return seen
