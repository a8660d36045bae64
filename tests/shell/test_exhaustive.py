"""No consumer of a closed union ignores a member, and module-level tables are read-only.

mypy proves the first for every consumer that ``match``es and ends in ``case _: assert_never(x)``:
a new op kind, action or enum member not handled there fails type checking. These tests check
the same property two more ways, so that it cannot quietly erode:

- statically: every ``match`` in ``fsdp_core`` and ``fsdp_shell`` ends in ``case _:
  assert_never(<its subject>)``, and no function dispatches on an op or action parameter with
  ``isinstance``, ``type`` or ``getattr``;
- at run time: one instance of every kind of ``typing.get_args(Op)`` (built from its fields, so a
  new kind reaches every consumer here without editing this file) goes through every consumer,
  which must give it a specific answer (an ``assert_never`` default raises ``AssertionError``);
  likewise every ``UnshardAction`` and every member of the enums consumers map. The hand-worked
  tables (each kind's buffers and simulated seconds) need a row for a new kind.

``tests/meta/test_exhaustive_mypy.py`` runs mypy itself on a copy of the packages with a dummy kind
added. Module-level tables in ``fsdp_core`` are ``MappingProxyType``: the last tests find every
one and try to change it.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import enum
import importlib
import pkgutil
import typing
from pathlib import Path
from types import MappingProxyType
from typing import Any, cast

import pytest
import torch

import fsdp_core
from fsdp_core import (
    PLAN_BUILDERS,
    AllReduce,
    AwaitGather,
    Buffer,
    CommHook,
    CommHookCall,
    Destination,
    Device,
    Event,
    FlatParamLayout,
    Gather,
    Group,
    Input,
    InputRole,
    Op,
    Plan,
    PlanRequest,
    ReduceKind,
    ReduceOpSpec,
    ReduceScatter,
    Reshard,
    ShardingSpec,
    ShardingStrategy,
    Stream,
    UnshardAction,
    UnshardRequest,
    UnshardSchedule,
    UnshardStep,
    action_name,
    carried_role,
    check_plan,
    check_unshard,
    comm_volume,
    format_plan,
    format_unshard,
    op_name,
    plan_to_json,
    plan_unshard,
    unshard_to_json,
)
from fsdp_core.plan.render import describe_op
from fsdp_core.plan.request import buffers_of
from fsdp_core.sim import CostModel, simulate_timeline
from fsdp_shell.runtime.simulate import SimulationError, WorldGeometry, simulate
from fsdp_shell.units.flat_param import FlatParamHandle
from fsdp_shell.units.unshard import UnshardRunner

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "fsdp_core").rglob("*.py"), *(ROOT / "fsdp_shell").rglob("*.py")])

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
        "Divide": ("buffer",),
        "ReduceScatter": ("src", "dst"),
        "AllReduce": ("buffer",),
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
    # element-wise over device bandwidth 1 B/s: read 32 + write 32; divide reads and writes 32;
    # accumulate reads src, reads and writes dst.
    "Cast": 64.0,
    "Pad": 64.0,
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


# -- every action kind through every consumer ------------------------------------------------

SCHEDULE_REQUEST = UnshardRequest(
    units=1,
    root=0,
    forward_order=(0,),
    backward_order=(0,),
    reshard_after_forward=False,
    plan_reshards=True,
    reshard_at_end_of_backward=True,
)


def schedule_with(action: UnshardAction) -> UnshardSchedule:
    """The on-demand schedule, with ``action`` as the whole pre-backward of unit 0."""
    step = UnshardStep(event=Event.PRE_BACKWARD, unit=0, actions=(action,))
    return UnshardSchedule(request=SCHEDULE_REQUEST, steps=(step,))


class FakeHandle:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def start_unshard(self) -> None:
        self.calls.append("start_unshard")

    def finish_unshard(self) -> None:
        self.calls.append("finish_unshard")

    def free_unsharded(self) -> None:
        self.calls.append("free_unsharded")


def test_every_action_kind_is_named() -> None:
    assert {action_name(kind(unit=0)) for kind in ACTION_KINDS} == {"gather", "await", "reshard"}


@pytest.mark.parametrize("kind", ACTION_KINDS, ids=by_name)
def test_every_action_kind_through_every_consumer(kind: type) -> None:
    action: UnshardAction = kind(unit=0)
    schedule = schedule_with(action)
    rows = [line.split() for line in format_unshard(schedule).splitlines()]
    assert ["0", "pre_backward", "0", action_name(action), "0"] in rows
    steps = unshard_to_json(schedule)["steps"]
    assert isinstance(steps, list) and steps[0] == {
        "event": "pre_backward",
        "unit": 0,
        "actions": [{"action": action_name(action), "unit": 0}],
    }
    # Unit 0 is the root, so it is still gathered from forward when its backward starts: gathering
    # it again is a double gather, awaiting it is harmless, resharding it leaves its backward
    # running on a sharded parameter.
    rules = {p.rule.value for p in check_unshard(schedule)}
    expected_rules: dict[type, set[str]] = {Gather: {"double_gather"}, AwaitGather: set(), Reshard: {"ungathered_use"}}
    assert rules == expected_rules[kind]
    entries = simulate_timeline(one_op_plan(OPS[Input]), unshard=schedule)
    assert [e.op for e in entries if e.op_index < 0] == (["all_gather"] if kind is Gather else [])
    handle = FakeHandle()
    runner = UnshardRunner(
        [cast(FlatParamHandle, handle)],
        0,
        strategy=ShardingStrategy.SHARD_GRAD_OP,
        low_precision=False,
        backward_prefetch=None,
        forward_prefetch=False,
    )
    runner.schedule = schedule
    runner.run(Event.PRE_BACKWARD, 0)
    expected_calls: dict[type, str] = {
        Gather: "start_unshard",
        AwaitGather: "finish_unshard",
        Reshard: "free_unsharded",
    }
    assert handle.calls == [expected_calls[kind]]


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


# -- statically: every match ends in assert_never, no dispatch by isinstance --------------------


def _matches(tree: ast.AST) -> list[ast.Match]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Match)]


def _ends_in_assert_never(match: ast.Match) -> bool:
    last = match.cases[-1]
    if not (isinstance(last.pattern, ast.MatchAs) and last.pattern.pattern is None and last.pattern.name is None):
        return False
    if last.guard is not None or len(last.body) != 1 or not isinstance(last.body[0], ast.Expr):
        return False
    call = last.body[0].value
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "assert_never"
        and len(call.args) == 1
        and ast.dump(call.args[0]) == ast.dump(match.subject)
    )


def test_every_match_ends_in_assert_never() -> None:
    found = 0
    bad: list[str] = []
    for path in SOURCES:
        for match in _matches(ast.parse(path.read_text(), filename=str(path))):
            found += 1
            if not _ends_in_assert_never(match):
                bad.append(f"{path.relative_to(ROOT)}:{match.lineno}: match {ast.unparse(match.subject)}")
    assert found >= 30, "the walk finds the package's matches"
    assert bad == [], "every match must end in `case _: assert_never(<subject>)`:\n" + "\n".join(bad)


UNIONS = {"Op", "UnshardAction"}


def _dispatches_on_parameter(function: ast.FunctionDef) -> list[str]:
    params = {
        a.arg
        for a in [*function.args.args, *function.args.kwonlyargs]
        if a.annotation is not None and ast.unparse(a.annotation) in UNIONS
    }
    out: list[str] = []
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "type", "getattr")
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in params
        ):
            out.append(f"{function.name}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_dispatch_on_an_op_or_action_but_match() -> None:
    bad: list[str] = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                bad += [f"{path.relative_to(ROOT)}: {b}" for b in _dispatches_on_parameter(node)]
    assert bad == [], "dispatch on an op or action with match ... assert_never:\n" + "\n".join(bad)


def test_the_static_checks_catch_what_they_forbid() -> None:
    wildcard = ast.parse("match op:\n    case Input():\n        pass\n    case _:\n        return None\n")
    listed = ast.parse("match op:\n    case Input():\n        pass\n    case _:\n        assert_never(op)\n")
    other = ast.parse("match op:\n    case Input():\n        pass\n    case _:\n        assert_never(other)\n")
    assert [_ends_in_assert_never(m) for t in (wildcard, listed, other) for m in _matches(t)] == [False, True, False]
    ladder = ast.parse("def f(op: Op) -> int:\n    return 1 if isinstance(op, Input) else _N[type(op)]\n")
    function = ladder.body[0]
    assert isinstance(function, ast.FunctionDef) and len(_dispatches_on_parameter(function)) == 2


# -- module-level tables are read-only ------------------------------------------------------


def _core_modules() -> list[Any]:
    """Every module of ``fsdp_core``, its subpackages' included."""
    found = pkgutil.walk_packages(fsdp_core.__path__, prefix="fsdp_core.")
    modules = [importlib.import_module(m.name) for m in found]
    assert len(modules) >= 20 and {"fsdp_core.plan.planner", "fsdp_core.sim.iteration"} <= {m.__name__ for m in modules}
    return modules


def _tables() -> dict[str, MappingProxyType[Any, Any]]:
    return {
        f"{module.__name__}.{name}": value
        for module in _core_modules()
        for name, value in vars(module).items()
        if isinstance(value, MappingProxyType)
    }


def test_no_mutable_module_level_container_in_core() -> None:
    mutable = [
        f"{module.__name__}.{name}"
        for module in _core_modules()
        for name, value in vars(module).items()
        if not name.startswith("__") and isinstance(value, (dict, list, set, bytearray))
    ]
    assert mutable == []


def test_the_tables_are_found() -> None:
    assert set(_tables()) >= {
        "fsdp_core.plan.planner.PLAN_BUILDERS",
        "fsdp_core.plan.planner._DTYPE_TAGS",
        "fsdp_core.sim.timeline._MARKS",
        "fsdp_core.unshard.verifier._USE",
    }


@pytest.mark.parametrize("name", sorted(_tables()))
def test_module_level_tables_refuse_mutation(name: str) -> None:
    table = _tables()[name]
    key = next(iter(table))
    with pytest.raises(TypeError):
        table[key] = table[key]  # type: ignore[index]
    with pytest.raises(TypeError):
        del table[key]  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        table.clear()  # type: ignore[attr-defined]


def test_plan_builders_refuse_mutation() -> None:
    assert set(PLAN_BUILDERS) == set(ShardingStrategy)
    with pytest.raises(TypeError):
        PLAN_BUILDERS[ShardingStrategy.FULL_SHARD] = ()  # type: ignore[index]
    assert PLAN_BUILDERS is fsdp_core.PLAN_BUILDERS
