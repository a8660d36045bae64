"""Collectives' operands, inside a gloo world: a gather's ``Pending`` waits without its operands,
and the library's synchronous collectives return only once gloo's threads hold none of their
tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp_shell import FSDP
from fsdp_shell.runtime.collectives import (
    Pending,
    all_gather_flat,
    all_reduce_flat,
    broadcast_flat,
    reduce_scatter_flat,
    use_count,
)
from tests.worlds.runtime_cases import Layer, make_model, train_against_reference

# -- a gather's Pending needs no operands ----------------------------------------------------


@dataclass
class OperandFree:
    """All-gathers completed through ``Pending`` records that hold no tensors."""

    gathered: list[float] = field(default_factory=list)
    """A bare all-gather's result, waited through ``Pending(work)`` after ``src`` was dropped."""
    ref_diff: float = 0.0
    """Training with every unit's all-gather handed back without operands, against the reference."""
    diff_from_held: float = 0.0
    """The same training with the operands held, against the one without: the same numbers."""
    stripped: int = 0
    """How many all-gathers were handed back without operands."""


def operand_free_gathers(rank: int, world: int, arg: None) -> OperandFree:
    """The CUDA runtime's sharded all-gather once passed its waiter no operands, and the waiter
    asserted some: the first sharded gather on a GPU failed. ``Pending`` waits the same with or
    without them, on its own and inside a unit's gather."""
    seen = OperandFree()
    src = torch.full((3,), float(rank + 1))
    dst = torch.empty(3 * world)
    world_group = dist.group.WORLD
    assert isinstance(world_group, dist.ProcessGroup)
    work = all_gather_flat(dst, src, world_group, async_op=True)
    assert work is not None
    pending = Pending(work)
    del src
    pending.wait()
    seen.gathered = dst.tolist()
    stripped = FSDP(make_model(32, 4), auto_wrap_policy={Layer})
    runtime = stripped._tree.runtime
    gather = runtime.all_gather

    def without_operands(out: torch.Tensor, src: torch.Tensor) -> Pending | None:
        issued = gather(out, src)
        if issued is None:
            return None
        seen.stripped += 1
        return Pending(issued.work)

    runtime.all_gather = without_operands  # type: ignore[method-assign]  # test-only instrumentation
    seen.ref_diff = train_against_reference(stripped, make_model(32, 4), rank, world)
    held = FSDP(make_model(32, 4), auto_wrap_policy={Layer})
    train_against_reference(held, make_model(32, 4), rank, world)
    mine, theirs = stripped.full_state_dict(), held.full_state_dict()
    seen.diff_from_held = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
    return seen


RELEASE_CALLS = 200
"""Calls of each synchronous collective ``released_operands`` makes."""


def released_operands(rank: int, world: int, arg: None) -> dict[str, int]:
    """In how many of ``RELEASE_CALLS`` calls of each synchronous collective gloo's threads still
    held one of its tensors when the call returned: torch's own calls (the probe's baseline) and
    the library's, which wait until they have let go (``fsdp_shell.runtime.collectives``)."""
    group = dist.group.WORLD
    assert group is not None
    src, out = torch.randn(1000), torch.empty(1000 * world)

    def held_after(call: Callable[[], object], *tensors: torch.Tensor) -> int:
        held = 0
        for _ in range(RELEASE_CALLS):
            before = [use_count(t) for t in tensors]
            call()
            held += any(use_count(t) > n for t, n in zip(tensors, before))
        return held

    return {
        "torch all_gather_into_tensor": held_after(lambda: dist.all_gather_into_tensor(out, src), src, out),
        "torch all_reduce": held_after(lambda: dist.all_reduce(src), src),
        "all_gather_flat": held_after(lambda: all_gather_flat(out, src, group), src, out),
        "reduce_scatter_flat": held_after(lambda: reduce_scatter_flat(src, out, group), src, out),
        "all_reduce_flat": held_after(lambda: all_reduce_flat(src, group), src),
        "broadcast_flat": held_after(lambda: broadcast_flat(src, 0), src),
    }
