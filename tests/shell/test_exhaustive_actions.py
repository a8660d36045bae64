"""Every ``UnshardAction`` kind through every consumer, at run time: the text and JSON renderings,
the checker, the timeline and the shell's runner each give it a specific answer (an
``assert_never`` default raises ``AssertionError``).
"""

from __future__ import annotations

from typing import cast

import pytest

from fsdp_core import (
    AwaitGather,
    Event,
    Gather,
    Input,
    Reshard,
    ShardingStrategy,
    UnshardAction,
    UnshardSchedule,
    UnshardStep,
    action_name,
    check_unshard,
    format_unshard,
    unshard_to_json,
)
from fsdp_core.sim import simulate_timeline
from fsdp_shell.units.flat_param import FlatParamHandle
from fsdp_shell.units.unshard import UnshardRunner
from tests.shell.exhaustive_cases import ACTION_KINDS, OPS, SCHEDULE_REQUEST, by_name, one_op_plan

# -- every action kind through every consumer ------------------------------------------------


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
