"""Documentation examples, the broken ones: docs/verifier.md's sound base plan and how each
variant breaks it (an op removed, moved, repeated or retargeted), and the edit that breaks an
all-gather schedule; ``scripts/doc_examples_catalog.py`` names them.

Nothing here checks a plan; ``check_plan`` and ``check_unshard`` report what each variant
breaks when the block is rendered (``scripts/doc_examples_render.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

import torch

from fsdp_core import (
    AllReduce,
    Buffer,
    Event,
    FlatParamLayout,
    Free,
    GradViews,
    Group,
    HandOff,
    Op,
    Pad,
    Plan,
    ReduceOpSpec,
    ReduceScatter,
    ShardingSpec,
    ShardingStrategy,
    StepFlags,
    Stream,
    UnshardAction,
    UnshardSchedule,
    plan_post_backward,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_D = TypeVar("_D", bound="DataclassInstance")

TINY = FlatParamLayout.of([("w", (3,))], torch.float32)
"""Three elements over two ranks: the verifier's base plan."""

TINY_ORIG = FlatParamLayout.of([("a", (3,)), ("b", (2,))], torch.float32, align=True)

FULL2 = ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 2)


def verifier_base() -> Plan:
    return plan_post_backward(TINY, FULL2)


def with_ops(plan: Plan, ops: Sequence[Op]) -> Plan:
    return replace(plan, ops=tuple(ops))


def without(plan: Plan, kind: type) -> Plan:
    """``plan`` minus every op of type ``kind``."""
    return with_ops(plan, [op for op in plan.ops if not isinstance(op, kind)])


def _replace_buffers(op: _D, changes: dict[str, Buffer]) -> _D:
    return replace(op, **changes)


def retarget(plan: Plan, name: str, new: Callable[[Buffer], Buffer]) -> Plan:
    """``plan`` with the buffer called ``name`` replaced by ``new(buffer)`` in every op."""

    def fix(op: Op) -> Op:
        changes = {
            field: new(value)
            for field in ("buffer", "src", "dst")
            if isinstance(value := getattr(op, field, None), Buffer) and value.name == name
        }
        return _replace_buffers(op, changes) if changes else op

    return with_ops(plan, [fix(op) for op in plan.ops])


def _index(ops: Sequence[Op], kind: type, start: int = 0) -> int:
    """Index of the first op of type ``kind`` at or after ``start``."""
    return next(i for i in range(start, len(ops)) if isinstance(ops[i], kind))


def break_use_after_free() -> Plan:
    base = verifier_base()
    ops = list(base.ops)
    rs = _index(ops, ReduceScatter)
    ops.insert(rs, ops.pop(_index(ops, Free, rs)))
    return with_ops(base, ops)


def break_redefined() -> Plan:
    base = verifier_base()
    ops = list(base.ops)
    pad = _index(ops, Pad)
    ops.insert(pad + 1, ops[pad])
    return with_ops(base, ops)


def break_reduction() -> Plan:
    base = verifier_base()
    ops = list(base.ops)
    rs = _index(ops, ReduceScatter)
    op = ops[rs]
    assert isinstance(op, ReduceScatter)
    ops.insert(rs + 1, AllReduce(buffer=op.dst, group=Group.SHARD, reduce_op=ReduceOpSpec(), stream=op.stream))
    return with_ops(base, ops)


def break_dropped_gradient() -> Plan:
    base = verifier_base()
    accumulating = plan_post_backward(TINY, FULL2, flags=StepFlags(accumulate=True))
    return replace(base, request=accumulating.request)


def break_leak() -> Plan:
    base = verifier_base()
    return with_ops(base, [op for op in base.ops if not (isinstance(op, Free) and op.buffer.name == "grad.padded")])


def break_hand_off() -> Plan:
    base = verifier_base()
    return with_ops(
        base,
        [replace(op, stream=Stream.POST_BACKWARD) if isinstance(op, HandOff) else op for op in base.ops],
    )


def break_views() -> Plan:
    spec = ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 2)
    base = plan_post_backward(TINY_ORIG, spec, use_orig_params=True)
    rank1 = spec.shard_views(TINY_ORIG, rank=1)
    return with_ops(base, [replace(op, views=rank1) if isinstance(op, GradViews) else op for op in base.ops])


def with_actions(
    schedule: UnshardSchedule, changes: Mapping[tuple[Event, int], tuple[UnshardAction, ...]]
) -> UnshardSchedule:
    """``schedule`` with the actions of the given (event, unit) steps replaced."""
    steps = tuple(replace(s, actions=changes.get((s.event, s.unit), s.actions)) for s in schedule.steps)
    return UnshardSchedule(request=schedule.request, steps=steps)
