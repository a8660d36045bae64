"""Every op kind through every consumer, at run time: one instance of every kind of
``typing.get_args(Op)`` (built from its fields by ``exhaustive_cases``, so a new kind reaches
every consumer here without editing this file) goes through every consumer, which must give it a
specific answer (an ``assert_never`` default raises ``AssertionError``). The hand-worked tables
(each kind's buffers and simulated seconds) need a row for a new kind.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from fsdp_core import (
    AllReduce,
    Buffer,
    CommHook,
    CommHookCall,
    Group,
    ReduceScatter,
    Stream,
    check_plan,
    comm_volume,
    format_plan,
    op_name,
    plan_to_json,
)
from fsdp_core.plan.render import describe_op
from fsdp_core.plan.request import buffers_of
from fsdp_core.sim import CostModel, simulate_timeline
from fsdp_shell.runtime.simulate import SimulationError, simulate
from tests.shell.exhaustive_cases import NUMEL, OP_KINDS, OPS, REQUEST, by_name, one_op_plan


def test_every_op_kind_is_built() -> None:
    assert len(OP_KINDS) >= 16
    assert all(type(op) is kind for kind, op in OPS.items())


# -- every op kind through every consumer ----------------------------------------------------


def test_op_names_are_distinct_snake_case() -> None:
    names = [op_name(op) for op in OPS.values()]
    assert len(set(names)) == len(names)
    assert all(n and n == n.lower() and " " not in n for n in names)


@pytest.mark.parametrize("kind", OP_KINDS, ids=by_name)
def test_buffers_of_is_every_buffer_field(kind: type) -> None:
    op = OPS[kind]
    fields = {getattr(op, f.name) for f in dataclasses.fields(op)}
    assert set(buffers_of(op)) == {v for v in fields if isinstance(v, Buffer)}


def test_buffers_of_each_kind() -> None:
    got = {kind.__name__: tuple(b.name for b in buffers_of(op)) for kind, op in OPS.items()}
    assert got == {
        "Input": ("buffer",),
        "WaitStream": (),
        "RecordStream": ("buffer",),
        "Free": ("buffer",),
        "FreeUnshardedParam": (),
        "Cast": ("src", "dst"),
        "Pad": ("src", "dst"),
        "CopyIn": ("src", "dst"),
        "Divide": ("buffer",),
        "ReduceScatter": ("src", "dst"),
        "AllReduce": ("buffer",),
        "AllReduceHookCall": ("buffer",),
        "CommHookCall": ("src", "dst"),
        "Accumulate": ("src", "dst"),
        "Offload": ("src", "dst"),
        "GradViews": ("buffer",),
        "EndOfBackwardWait": (),
        "HandOff": ("buffer",),
    }
    src = Buffer(name="g", numel=NUMEL, dtype=torch.float32)
    in_place = CommHookCall(
        hook=CommHook.ALLREDUCE,
        src=src,
        dst=src,
        group=Group.SHARD,
        divides_by=2,
        wire_dtype=torch.float32,
        stream=Stream.COMPUTE,
    )
    assert buffers_of(in_place) == (src,)


@pytest.mark.parametrize("kind", OP_KINDS, ids=by_name)
def test_render_states_every_field(kind: type) -> None:
    op = OPS[kind]
    assert describe_op(op)
    assert f"  {op_name(op)}  " in format_plan(one_op_plan(op))
    ops = plan_to_json(one_op_plan(op))["ops"]
    assert isinstance(ops, list)
    shown = ops[0]
    assert isinstance(shown, dict) and shown["op"] == op_name(op)
    assert set(shown) == {"op"} | {f.name for f in dataclasses.fields(op)}


COLLECTIVES = {ReduceScatter: "reduce_scatter", AllReduce: "all_reduce", CommHookCall: "reduce_scatter"}
"""The kinds that communicate, and what runs on the wire (the dummy hook has src != dst)."""


@pytest.mark.parametrize("kind", OP_KINDS, ids=by_name)
def test_comm_volume_counts_exactly_the_collectives(kind: type) -> None:
    volumes = comm_volume(one_op_plan(OPS[kind]))
    assert [v.collective for v in volumes] == ([COLLECTIVES[kind]] if kind in COLLECTIVES else [])


SECONDS = {
    "Input": 0.0,
    "WaitStream": 0.0,
    "RecordStream": 0.0,
    "Free": 0.0,
    "FreeUnshardedParam": 0.0,
    "GradViews": 0.0,
    "EndOfBackwardWait": 0.0,
    "HandOff": 0.0,
    "AllReduceHookCall": 0.0,  # the user's work: not costed
    # element-wise over device bandwidth 1 B/s: read 32 + write 32; divide reads and writes 32;
    # accumulate reads src, reads and writes dst.
    "Cast": 64.0,
    "Pad": 64.0,
    "CopyIn": 64.0,
    "Divide": 64.0,
    "Accumulate": 96.0,
    # 32 bytes to the host at 4 B/s.
    "Offload": 8.0,
    # latency 100 s + ring bytes over the shard link (2 B/s) of a group of 2: a reduce-scatter of
    # 8 fp32 sends 1 chunk of 4 (16 B); an all-reduce twice that (32 B).
    "ReduceScatter": 108.0,
    "AllReduce": 116.0,
    "CommHookCall": 108.0,
}


@pytest.mark.parametrize("kind", OP_KINDS, ids=by_name)
def test_timeline_costs_every_kind(kind: type) -> None:
    cost = CostModel(
        device_bandwidth=1.0,
        intra_node_bandwidth=2.0,
        inter_node_bandwidth=1.0,
        host_bandwidth=4.0,
        collective_latency=100.0,
    )
    (entry,) = simulate_timeline(one_op_plan(OPS[kind]), cost)
    assert (entry.op, entry.op_index, entry.start) == (op_name(OPS[kind]), 0, 0.0)
    assert entry.end == pytest.approx(SECONDS[kind.__name__])


@pytest.mark.parametrize("kind", OP_KINDS, ids=by_name)
def test_verifier_steps_through_every_kind(kind: type) -> None:
    # A one-op plan is never sound; what matters is that the checker handles the op.
    problems = check_plan(one_op_plan(OPS[kind]))
    assert problems and all(p.op_index in (-1, 0) for p in problems)


@pytest.mark.parametrize("kind", OP_KINDS, ids=by_name)
def test_simulated_world_runs_every_kind(kind: type) -> None:
    # Most one-op plans cannot run (their operands do not exist); that is a SimulationError
    # raised inside the op's case. The default case would raise AssertionError instead.
    plan = one_op_plan(OPS[kind])
    grads = [torch.ones(NUMEL) for _ in range(4)]
    with contextlib.suppress(SimulationError):
        simulate(REQUEST, grads, planner=lambda request: plan)
