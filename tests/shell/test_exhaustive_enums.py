"""Every member of the enums that consumers map (groups, devices, destinations, comm hooks, reduce
kinds, events, input roles) gets a specific answer, worked out here by hand.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_core import (
    Buffer,
    CommHook,
    Destination,
    Device,
    Event,
    Group,
    Input,
    InputRole,
    ReduceKind,
    ReduceOpSpec,
    carried_role,
    check_plan,
    plan_unshard,
)
from fsdp_shell.runtime.simulate import WorldGeometry
from tests.shell.exhaustive_cases import NUMEL, REQUEST, SCHEDULE_REQUEST, one_op_plan

# -- every member of the enums consumers map ---------------------------------------------------


def test_every_enum_member_is_mapped() -> None:
    assert {g: REQUEST.group_size(g) for g in Group} == {Group.SHARD: 2, Group.REPLICATE: 2}
    geometry = WorldGeometry(shard_size=2, replicate_size=3)
    # rank 3 is replica 1, shard rank 1: its shard group is ranks 2, 3; its replicate group 1, 3, 5.
    assert {g: geometry.members(3, g) for g in Group} == {Group.SHARD: (2, 3), Group.REPLICATE: (1, 3, 5)}
    assert [str(Buffer(name="b", numel=2, dtype=torch.float16, device=d)) for d in Device] == [
        "b[2:float16]",
        "b[2:float16@host]",
    ]
    assert {d: carried_role(d) for d in Destination} == {
        Destination.SHARDED_GRAD: InputRole.SHARDED_GRAD,
        Destination.ACCUMULATED_GRAD: InputRole.SHARDED_GRAD,
        Destination.CPU_GRAD: InputRole.SHARDED_GRAD,
        Destination.UNSHARDED_GRAD: InputRole.PENDING_UNSHARDED,
        Destination.PARTIAL: InputRole.PENDING_PARTIAL,
    }
    assert {h: h.wire_dtype for h in CommHook} == {
        CommHook.NONE: None,
        CommHook.ALLREDUCE: None,
        CommHook.REDUCE_SCATTER: None,
        CommHook.FP16_COMPRESS: torch.float16,
        CommHook.BF16_COMPRESS: torch.bfloat16,
        CommHook.USER: None,
    }
    specs = [ReduceOpSpec(kind=k, premul=0.5 if k is ReduceKind.PREMUL_SUM else 1.0) for k in ReduceKind]
    assert [(str(s), s.scale(4)) for s in specs] == [("sum", 1.0), ("avg", 0.25), ("premul_sum(0.5)", 0.5)]
    assert {e: len(SCHEDULE_REQUEST.on_demand(e, 0)) for e in Event} == {
        Event.PRE_FORWARD: 2,
        Event.POST_FORWARD: 0,
        Event.END_FORWARD: 0,
        Event.PRE_BACKWARD: 2,
        Event.POST_BACKWARD: 0,
        Event.END_BACKWARD: 0,
    }
    assert len(plan_unshard(SCHEDULE_REQUEST).steps) == len(SCHEDULE_REQUEST.events)


@pytest.mark.parametrize("role", list(InputRole), ids=lambda r: r.value)
def test_verifier_values_every_input_role(role: InputRole) -> None:
    b = Buffer(name="in", numel=NUMEL, dtype=torch.float32)
    problems = check_plan(one_op_plan(Input(buffer=b, role=role)))
    assert problems and all(p.op_index in (-1, 0) for p in problems)
