"""One instance of every kind of the closed unions, shared by the exhaustiveness tests
(``test_exhaustive_*.py``).

No consumer of a closed union ignores a member, and module-level tables are read-only. mypy
proves the first for every consumer that ``match``es and ends in ``case _: assert_never(x)``: a
new op kind, action or enum member not handled there fails type checking. The tests check the
same property two more ways, so that it cannot quietly erode: statically
(``test_exhaustive_static.py``), and at run time, where one instance of every kind of
``typing.get_args(Op)``, built here from its fields (so a new kind reaches every consumer
without editing a test), goes through every consumer (``test_exhaustive_ops.py``), likewise every
``UnshardAction`` (``test_exhaustive_actions.py``) and every member of the enums consumers map
(``test_exhaustive_enums.py``). ``tests/meta/test_exhaustive_mypy.py`` runs mypy itself on a copy
of the packages with a dummy kind added; ``test_exhaustive_tables.py`` tries to change every
module-level table of ``fsdp_core``.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any

import torch

from fsdp_core import (
    Buffer,
    FlatParamLayout,
    Op,
    PerParamLayout,
    Plan,
    PlanRequest,
    ReduceOpSpec,
    ShardingSpec,
    ShardingStrategy,
    UnshardAction,
    UnshardRequest,
)

OP_KINDS: tuple[type, ...] = typing.get_args(Op)
ACTION_KINDS: tuple[type, ...] = typing.get_args(UnshardAction)
NUMEL = 8
"""Every dummy buffer: 8 float32 elements, 32 bytes."""


# -- one instance of every kind, built from its fields ------------------------------------


def _dummy(name: str, hint: Any) -> object:
    if hint is Buffer:
        return Buffer(name=name, numel=NUMEL, dtype=torch.float32)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return next(iter(hint))
    if hint is ReduceOpSpec:
        return ReduceOpSpec()
    if hint is PerParamLayout:
        return PerParamLayout.of([("w", (NUMEL,))], torch.float32, 2)
    if hint is torch.dtype:
        return torch.float32
    if hint is bool:
        return False
    if hint is int:
        return 2
    if hint is float:
        return 2.0
    if typing.get_origin(hint) is tuple:
        return ()
    raise TypeError(f"field {name}: teach _dummy to build a {hint!r}")


def dummy_op(kind: type) -> Op:
    """An instance of ``kind`` whose buffers are named after their fields (``src``, ``dst``,
    ``buffer``), whose enums are their first member (streams ``COMPUTE``, groups ``SHARD``,
    hooks ``NONE``) and whose numbers are 2."""
    hints = typing.get_type_hints(kind)
    fields = {f.name: _dummy(f.name, hints[f.name]) for f in dataclasses.fields(kind)}
    op: Op = kind(**fields)
    return op


OPS = {kind: dummy_op(kind) for kind in OP_KINDS}
REQUEST = PlanRequest(
    layout=FlatParamLayout.of([("w", (NUMEL,))], torch.float32),
    sharding=ShardingSpec(strategy=ShardingStrategy.HYBRID_SHARD, shard_size=2, replicate_size=2),
)


def one_op_plan(op: Op) -> Plan:
    return Plan(request=REQUEST, ops=(op,), factors=None)


def by_name(kind: type) -> str:
    return kind.__name__


# -- the unshard record every action kind runs under -----------------------------------

SCHEDULE_REQUEST = UnshardRequest(
    units=1,
    root=0,
    forward_order=(0,),
    backward_order=(0,),
    reshard_after_forward=False,
    plan_reshards=True,
    reshard_at_end_of_backward=True,
)
