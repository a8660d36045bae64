"""The all-gather schedule: exact schedules of a chain of four units worked out by hand for every
prefetch and reshard setting, what a chain records, schedules as hashable values, and the
on-demand actions for units and events the record lacks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fsdp_core import HookEvent, Rule, UnshardRequest, UnshardSchedule, check_unshard, format_unshard, plan_unshard
from tests.core.unshard_cases import POST, E, Row, a, chain, g, r, rows

# The 4-unit chain: root 0 wraps 1, 2, 3; forward 0 1 2 3; pre-backward hooks fire 0 3 2 1.
FORWARD_FULL_SHARD: list[Row] = [
    (E.PRE_FORWARD, 0, (g(0), a(0))),
    (E.PRE_FORWARD, 1, (g(1), a(1))),
    (E.POST_FORWARD, 1, (r(1),)),
    (E.PRE_FORWARD, 2, (g(2), a(2))),
    (E.POST_FORWARD, 2, (r(2),)),
    (E.PRE_FORWARD, 3, (g(3), a(3))),
    (E.POST_FORWARD, 3, (r(3),)),
    (E.POST_FORWARD, 0, ()),
]
FORWARD_PREFETCHED: list[Row] = [
    (E.PRE_FORWARD, 0, (g(0), a(0), g(1))),
    (E.PRE_FORWARD, 1, (a(1), g(2))),
    (E.POST_FORWARD, 1, (r(1),)),
    (E.PRE_FORWARD, 2, (a(2), g(3))),
    (E.POST_FORWARD, 2, (r(2),)),
    (E.PRE_FORWARD, 3, (a(3),)),
    (E.POST_FORWARD, 3, (r(3),)),
    (E.POST_FORWARD, 0, ()),
]
# The root keeps its parameter from forward: its pre-backward only prefetches.
BACKWARD_PRE: list[Row] = [
    (E.PRE_BACKWARD, 0, (g(3),)),
    (E.PRE_BACKWARD, 3, (a(3), g(2))),
    (E.POST_BACKWARD, 3, ()),
    (E.PRE_BACKWARD, 2, (a(2), g(1))),
    (E.POST_BACKWARD, 2, ()),
    (E.PRE_BACKWARD, 1, (a(1),)),
    (E.POST_BACKWARD, 1, ()),
    (E.POST_BACKWARD, 0, ()),
]
# The root's post-backward fires last, so unit 3, first after it, is not prefetched.
BACKWARD_POST: list[Row] = [
    (E.PRE_BACKWARD, 0, ()),
    (E.PRE_BACKWARD, 3, (g(3), a(3))),
    (E.POST_BACKWARD, 3, (g(2),)),
    (E.PRE_BACKWARD, 2, (a(2),)),
    (E.POST_BACKWARD, 2, (g(1),)),
    (E.PRE_BACKWARD, 1, (a(1),)),
    (E.POST_BACKWARD, 1, ()),
    (E.POST_BACKWARD, 0, ()),
]
BACKWARD_NONE: list[Row] = [
    (E.PRE_BACKWARD, 0, ()),
    (E.PRE_BACKWARD, 3, (g(3), a(3))),
    (E.POST_BACKWARD, 3, ()),
    (E.PRE_BACKWARD, 2, (g(2), a(2))),
    (E.POST_BACKWARD, 2, ()),
    (E.PRE_BACKWARD, 1, (g(1), a(1))),
    (E.POST_BACKWARD, 1, ()),
    (E.POST_BACKWARD, 0, ()),
]
# SHARD_GRAD_OP: nothing is freed after forward, so backward has nothing to gather or prefetch.
FORWARD_KEEP: list[Row] = [
    (E.PRE_FORWARD, 0, (g(0), a(0))),
    (E.PRE_FORWARD, 1, (g(1), a(1))),
    (E.POST_FORWARD, 1, ()),
    (E.PRE_FORWARD, 2, (g(2), a(2))),
    (E.POST_FORWARD, 2, ()),
    (E.PRE_FORWARD, 3, (g(3), a(3))),
    (E.POST_FORWARD, 3, ()),
    (E.POST_FORWARD, 0, ()),
]
FORWARD_KEEP_PREFETCHED: list[Row] = [
    (E.PRE_FORWARD, 0, (g(0), a(0), g(1))),
    (E.PRE_FORWARD, 1, (a(1), g(2))),
    (E.POST_FORWARD, 1, ()),
    (E.PRE_FORWARD, 2, (a(2), g(3))),
    (E.POST_FORWARD, 2, ()),
    (E.PRE_FORWARD, 3, (a(3),)),
    (E.POST_FORWARD, 3, ()),
    (E.POST_FORWARD, 0, ()),
]
BACKWARD_KEEP: list[Row] = [(ev, u, ()) for ev, u, _ in BACKWARD_NONE]


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (chain(), FORWARD_FULL_SHARD + BACKWARD_PRE),
        (chain(prefetch=POST), FORWARD_FULL_SHARD + BACKWARD_POST),
        (chain(prefetch=None), FORWARD_FULL_SHARD + BACKWARD_NONE),
        (chain(forward_prefetch=True), FORWARD_PREFETCHED + BACKWARD_PRE),
        (chain(prefetch=POST, forward_prefetch=True), FORWARD_PREFETCHED + BACKWARD_POST),
        (chain(prefetch=None, forward_prefetch=True), FORWARD_PREFETCHED + BACKWARD_NONE),
        # plan_reshards changes no action (the post-backward plan reshards), only the check.
        (chain(rab=False), FORWARD_FULL_SHARD + BACKWARD_PRE),
        (chain(raf=False), FORWARD_KEEP + BACKWARD_KEEP),
        (chain(raf=False, prefetch=POST), FORWARD_KEEP + BACKWARD_KEEP),
        (chain(raf=False, rab=False, prefetch=None), FORWARD_KEEP + BACKWARD_KEEP),
        (chain(raf=False, forward_prefetch=True), FORWARD_KEEP_PREFETCHED + BACKWARD_KEEP),
    ],
    ids=[
        "pre",
        "post",
        "none",
        "fwd-pre",
        "fwd-post",
        "fwd-none",
        "pre-no-reshard-after-backward",
        "zero2-pre",
        "zero2-post",
        "zero2-no-sync",
        "zero2-fwd",
    ],
)
def test_four_unit_chain_schedules(request_: UnshardRequest, expected: list[Row]) -> None:
    schedule = plan_unshard(request_)
    assert rows(schedule) == expected
    assert check_unshard(schedule) == []
    for event, unit, actions in expected:
        assert schedule.actions(event, unit) == actions


def test_chain_records_what_nested_fsdp_records() -> None:
    req = chain(units=4)
    assert (req.root, req.forward_order, req.backward_order) == (0, (0, 1, 2, 3), (0, 3, 2, 1))
    assert req.events == tuple(HookEvent(ev, u) for ev, u, _ in FORWARD_FULL_SHARD + BACKWARD_PRE)
    single = chain(units=1)
    assert single.events == (
        HookEvent(E.PRE_FORWARD, 0),
        HookEvent(E.POST_FORWARD, 0),
        HookEvent(E.PRE_BACKWARD, 0),
        HookEvent(E.POST_BACKWARD, 0),
    )


def test_schedules_are_hashable_values() -> None:
    one, two = plan_unshard(chain()), plan_unshard(chain())
    assert one == two and hash(one) == hash(two)
    assert {one: "cached"}[two] == "cached"
    assert plan_unshard(chain(prefetch=POST)) != one


def test_unrecorded_units_and_events_get_the_on_demand_actions() -> None:
    empty = plan_unshard(
        UnshardRequest(
            units=3,
            root=0,
            forward_order=(),
            backward_order=(),
            reshard_after_forward=True,
            plan_reshards=True,
            reshard_at_end_of_backward=True,
        )
    )
    assert empty.steps == ()
    assert check_unshard(empty) == []
    for unit in range(3):
        assert empty.actions(E.PRE_FORWARD, unit) == (g(unit), a(unit))
        assert empty.actions(E.PRE_BACKWARD, unit) == (g(unit), a(unit))
        assert empty.actions(E.POST_BACKWARD, unit) == ()
    assert empty.actions(E.POST_FORWARD, 0) == ()
    assert empty.actions(E.POST_FORWARD, 2) == (r(2),)

    # Unit 4 did not run on the recorded iteration, unit 3's pre-backward hook did not fire.
    partial = plan_unshard(
        UnshardRequest(
            units=5,
            root=0,
            forward_order=(0, 1, 2, 3),
            backward_order=(0, 2, 1),
            reshard_after_forward=True,
            plan_reshards=True,
            reshard_at_end_of_backward=True,
            forward_prefetch=True,
        )
    )
    assert check_unshard(partial) == []
    assert partial.actions(E.PRE_FORWARD, 3) == (a(3),)
    assert partial.actions(E.PRE_FORWARD, 4) == (g(4), a(4))
    assert partial.actions(E.POST_FORWARD, 4) == (r(4),)
    assert partial.actions(E.PRE_BACKWARD, 3) == (g(3), a(3))
    assert partial.actions(E.PRE_BACKWARD, 4) == (g(4), a(4))
    assert partial.actions(E.POST_BACKWARD, 4) == ()

    keep = plan_unshard(replace(chain(raf=False), forward_order=(), backward_order=()))
    assert keep.actions(E.POST_FORWARD, 2) == ()
    with pytest.raises(ValueError, match="unit"):
        keep.actions(E.PRE_FORWARD, 4)


def test_prefetch_targets_only_units_that_need_gathering() -> None:
    # The root, first in backward order here, keeps its parameter: nothing prefetches it, and
    # unit 2 after it is prefetched by the root's pre-backward.
    req = UnshardRequest(
        units=3,
        root=0,
        forward_order=(0, 1, 2),
        backward_order=(1, 0, 2),
        reshard_after_forward=True,
        plan_reshards=True,
        reshard_at_end_of_backward=True,
    )
    schedule = plan_unshard(req)
    assert schedule.actions(E.PRE_BACKWARD, 1) == (g(1), a(1))
    assert schedule.actions(E.PRE_BACKWARD, 0) == (g(2),)
    assert schedule.actions(E.PRE_BACKWARD, 2) == (a(2),)
    assert check_unshard(schedule) == []
    # A unit whose backward runs without a recorded forward is gathered there.
    cold = plan_unshard(
        UnshardRequest(
            units=2,
            root=0,
            forward_order=(),
            backward_order=(0, 1),
            reshard_after_forward=False,
            plan_reshards=True,
            reshard_at_end_of_backward=True,
        )
    )
    assert cold.actions(E.PRE_BACKWARD, 0) == (g(0), a(0), g(1))
    assert cold.actions(E.PRE_BACKWARD, 1) == (a(1),)
    assert check_unshard(cold) == []


def test_each_unit_reshards_as_fully_shard_says_the_root_included() -> None:
    """fully_shard's per-unit ``reshard_after_forward``: here the root (0) reshards after its
    forward and unit 2 keeps its parameter. Backward then gathers the root first, prefetches 3
    (2 is still gathered, so nothing prefetches it) and, from 2's hook, prefetches 1."""
    request = replace(chain(), forward_reshards=(True, True, False, True))
    assert [request.reshards_after_forward(u) for u in range(4)] == [True, True, False, True]
    assert [chain().reshards_after_forward(u) for u in range(4)] == [False, True, True, True]  # FSDP1: not the root
    schedule = plan_unshard(request)
    assert check_unshard(schedule) == []
    assert rows(schedule) == [
        (E.PRE_FORWARD, 0, (g(0), a(0))),
        (E.PRE_FORWARD, 1, (g(1), a(1))),
        (E.POST_FORWARD, 1, (r(1),)),
        (E.PRE_FORWARD, 2, (g(2), a(2))),
        (E.POST_FORWARD, 2, ()),
        (E.PRE_FORWARD, 3, (g(3), a(3))),
        (E.POST_FORWARD, 3, (r(3),)),
        (E.POST_FORWARD, 0, (r(0),)),
        (E.PRE_BACKWARD, 0, (g(0), a(0), g(3))),
        (E.PRE_BACKWARD, 3, (a(3),)),
        (E.POST_BACKWARD, 3, ()),
        (E.PRE_BACKWARD, 2, (g(1),)),
        (E.POST_BACKWARD, 2, ()),
        (E.PRE_BACKWARD, 1, (a(1),)),
        (E.POST_BACKWARD, 1, ()),
        (E.POST_BACKWARD, 0, ()),
    ]
    assert "after forward: reshard units 0 1 3;" in format_unshard(schedule)


def test_explicit_prefetch_lists_gather_what_is_sharded_in_their_order() -> None:
    """fully_shard's explicit lists on the 4-unit chain (root 0): unit 1's forward prefetches 2
    and 3, the root's backward prefetches 3 and 2, unit 2's prefetches 1; unit 3 keeps the
    default (the next unit, 2), which is in flight already, so it gathers nothing."""
    request = replace(
        chain(),
        forward_prefetches=((), (2, 3), (), ()),
        backward_prefetches=((3, 2), (), (1,), ()),
    )
    assert request.prefetch_depth == 2
    schedule = plan_unshard(request)
    assert check_unshard(schedule) == []
    assert rows(schedule) == [
        (E.PRE_FORWARD, 0, (g(0), a(0))),
        (E.PRE_FORWARD, 1, (g(1), a(1), g(2), g(3))),
        (E.POST_FORWARD, 1, (r(1),)),
        (E.PRE_FORWARD, 2, (a(2),)),
        (E.POST_FORWARD, 2, (r(2),)),
        (E.PRE_FORWARD, 3, (a(3),)),
        (E.POST_FORWARD, 3, (r(3),)),
        (E.POST_FORWARD, 0, ()),
        (E.PRE_BACKWARD, 0, (g(3), g(2))),
        (E.PRE_BACKWARD, 3, (a(3),)),
        (E.POST_BACKWARD, 3, ()),
        (E.PRE_BACKWARD, 2, (a(2), g(1))),
        (E.POST_BACKWARD, 2, ()),
        (E.PRE_BACKWARD, 1, (a(1),)),
        (E.POST_BACKWARD, 1, ()),
        (E.POST_BACKWARD, 0, ()),
    ]
    # the same gathers one unit ahead at most would be two ahead: the depth rule names them

    shallow = UnshardSchedule(
        request=replace(request, forward_prefetches=(), backward_prefetches=()), steps=schedule.steps
    )
    assert [p.rule for p in check_unshard(shallow)] == [Rule.PREFETCH_DEPTH, Rule.PREFETCH_DEPTH]
    text = format_unshard(schedule)
    assert "  forward prefetch: 1 -> 2 3\n" in text and "  backward prefetch: 0 -> 3 2; 2 -> 1\n" in text


def test_a_unit_backward_does_not_gather_and_one_kept_after_backward_as_fully_shard_says() -> None:
    """fully_shard's ``set_unshard_in_backward(False)`` on unit 1 (an embedding: its backward
    reads none of its parameters) and ``reshard_after_backward=False`` on unit 2: backward never
    gathers 1, not even as the prefetch of 2's hook, and 2's plan leaves it gathered, as does the
    end of backward."""
    request = replace(chain(), backward_gathers=(True, False, True, True), backward_reshards=(True, True, False, True))
    assert [(request.gathers_for_backward(u), request.plan_reshards_unit(u)) for u in range(4)] == [
        (True, True),
        (False, True),
        (True, False),
        (True, True),
    ]
    assert [request.reshards_at_end_of_backward(u) for u in range(4)] == [True, True, False, True]
    schedule = plan_unshard(request)
    assert check_unshard(schedule) == []
    assert rows(schedule)[8:] == [
        (E.PRE_BACKWARD, 0, (g(3),)),
        (E.PRE_BACKWARD, 3, (a(3), g(2))),
        (E.POST_BACKWARD, 3, ()),
        (E.PRE_BACKWARD, 2, (a(2),)),
        (E.POST_BACKWARD, 2, ()),
        (E.PRE_BACKWARD, 1, ()),
        (E.POST_BACKWARD, 1, ()),
        (E.POST_BACKWARD, 0, ()),
    ]
    assert "after backward: reshard units 0 1 3; not gathered for backward: 1" in format_unshard(schedule)
    assert schedule.actions(E.PRE_BACKWARD, 1) == () and request.on_demand(E.PRE_BACKWARD, 1) == ()
    gathering = replace(request, backward_gathers=())
    assert [p.rule for p in check_unshard(UnshardSchedule(request=gathering, steps=schedule.steps))] == [
        Rule.UNGATHERED_USE
    ]
