"""The all-gather schedule: exact schedules worked out by hand, on-demand fallbacks, every
``check_unshard`` rule on a broken schedule, and the planner's schedules checking clean for random
records."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsdp_core import (
    AwaitGather,
    BackwardPrefetch,
    Event,
    Gather,
    HookEvent,
    Problem,
    Reshard,
    Rule,
    UnshardAction,
    UnshardRequest,
    UnshardSchedule,
    UnshardStep,
    check_unshard,
    format_unshard,
    plan_unshard,
)
from tests.budget import budget

E = Event
PRE, POST = BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST


def g(u: int) -> Gather:
    return Gather(unit=u)


def a(u: int) -> AwaitGather:
    return AwaitGather(unit=u)


def r(u: int) -> Reshard:
    return Reshard(unit=u)


Row = tuple[Event, int, tuple[UnshardAction, ...]]


def chain(
    raf: bool = True,
    rab: bool = True,
    prefetch: BackwardPrefetch | None = PRE,
    forward_prefetch: bool = False,
    units: int = 4,
) -> UnshardRequest:
    return UnshardRequest.chain(
        units,
        reshard_after_forward=raf,
        plan_reshards=rab,
        backward_prefetch=prefetch,
        forward_prefetch=forward_prefetch,
    )


def rows(schedule: UnshardSchedule) -> list[Row]:
    return [(s.event, s.unit, s.actions) for s in schedule.steps]


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


# -- the checker: one broken variant of the sound BACKWARD_PRE chain per rule ----------------------


def broken(
    changes: dict[tuple[Event, int], tuple[UnshardAction, ...]], request_: UnshardRequest | None = None
) -> list[tuple[Rule, int]]:
    base = plan_unshard(request_ or chain())
    steps = tuple(replace(s, actions=changes.get((s.event, s.unit), s.actions)) for s in base.steps)
    return [(p.rule, p.op_index) for p in check_unshard(UnshardSchedule(request=base.request, steps=steps))]


# Event indices of the chain: 0 pre_forward 0, 1 pre_forward 1, 2 post_forward 1, ..., 7 post_forward 0,
# 8 pre_backward 0, 9 pre_backward 3, 10 post_backward 3, 11 pre_backward 2, 12 post_backward 2,
# 13 pre_backward 1, 14 post_backward 1, 15 post_backward 0.


def test_ungathered_use() -> None:
    assert broken({(E.PRE_FORWARD, 1): (g(1),), (E.POST_FORWARD, 1): (a(1), r(1))}) == [(Rule.UNGATHERED_USE, 1)]
    # Unit 3's all-gather (prefetched by the root) is never awaited: its backward runs on it anyway.
    assert broken({(E.PRE_BACKWARD, 3): (g(2),)}) == [(Rule.UNGATHERED_USE, 9), (Rule.UNAWAITED_GATHER, -1)]
    # Not awaited, then resharded while still in flight.
    assert broken({(E.PRE_FORWARD, 1): (g(1),)}) == [(Rule.UNGATHERED_USE, 1), (Rule.UNSAFE_RESHARD, 2)]


def test_double_gather() -> None:
    assert broken({(E.PRE_BACKWARD, 3): (g(3), a(3), g(2))}) == [(Rule.DOUBLE_GATHER, 9)]
    assert broken({(E.PRE_FORWARD, 1): (g(1), a(1), g(0))}) == [(Rule.DOUBLE_GATHER, 1)]


def test_unsafe_reshard() -> None:
    # Freeing a sharded unit, an in-flight one, and the root while its forward runs.
    assert broken({(E.POST_FORWARD, 1): (r(1), r(1))}) == [(Rule.UNSAFE_RESHARD, 2)]
    assert broken({(E.PRE_BACKWARD, 0): (g(3), r(3))}) == [(Rule.UNSAFE_RESHARD, 8)]
    assert broken({(E.POST_FORWARD, 1): (r(1), r(0))}) == [
        (Rule.UNSAFE_RESHARD, 2),
        (Rule.FORWARD_RESHARD, 7),
        (Rule.UNGATHERED_USE, 8),
    ]


def test_prefetch_depth() -> None:
    assert broken({(E.PRE_BACKWARD, 0): (g(3), g(2)), (E.PRE_BACKWARD, 3): (a(3),)}) == [(Rule.PREFETCH_DEPTH, 8)]
    assert broken(
        {(E.PRE_FORWARD, 0): (g(0), a(0), g(1), g(2)), (E.PRE_FORWARD, 1): (a(1),), (E.PRE_FORWARD, 2): (a(2),)}
    ) == [(Rule.PREFETCH_DEPTH, 0)]


def test_unawaited_gather() -> None:
    assert broken({(E.PRE_BACKWARD, 1): (a(1), g(2))}) == [(Rule.UNAWAITED_GATHER, -1)]


def test_unused_gather() -> None:
    assert broken({(E.POST_BACKWARD, 1): (g(3), a(3))}) == [(Rule.UNUSED_GATHER, -1)]
    assert broken(
        {
            (E.PRE_FORWARD, 1): (g(1), a(1), g(3), a(3)),
            (E.PRE_FORWARD, 2): (g(2), a(2), r(3)),
            (E.PRE_FORWARD, 3): (g(3), a(3)),
        }
    ) == [(Rule.UNUSED_GATHER, 3)]


def test_forward_reshard() -> None:
    assert broken({(E.POST_FORWARD, 2): ()}) == [(Rule.FORWARD_RESHARD, 4), (Rule.DOUBLE_GATHER, 9)]
    keep = chain(raf=False)
    assert broken({(E.POST_FORWARD, 2): (r(2),), (E.PRE_BACKWARD, 2): (g(2), a(2))}, keep) == [
        (Rule.FORWARD_RESHARD, 4)
    ]


def test_every_unshard_rule_has_a_test_above() -> None:
    unshard_rules = list(Rule)[list(Rule).index(Rule.UNGATHERED_USE) :]
    tested = {
        Rule.UNGATHERED_USE,
        Rule.DOUBLE_GATHER,
        Rule.UNSAFE_RESHARD,
        Rule.PREFETCH_DEPTH,
        Rule.UNAWAITED_GATHER,
        Rule.UNUSED_GATHER,
        Rule.FORWARD_RESHARD,
    }
    assert set(unshard_rules) == tested


def test_the_post_backward_reshard_is_modelled() -> None:
    # With plan_reshards the post-backward plan frees unit 3: resharding it again fails,
    # and gathering it again for a later use is allowed.
    assert broken({(E.POST_BACKWARD, 3): (r(3),)}) == [(Rule.UNSAFE_RESHARD, 10)]
    assert broken({(E.POST_BACKWARD, 3): (r(3),)}, chain(rab=False)) == []


def test_problems_name_the_hook() -> None:
    base = plan_unshard(chain())
    changes = {(E.PRE_FORWARD, 1): (g(1),), (E.POST_FORWARD, 1): (a(1), r(1))}
    steps = tuple(replace(s, actions=changes.get((s.event, s.unit), s.actions)) for s in base.steps)
    found = check_unshard(UnshardSchedule(request=base.request, steps=steps))
    assert found == [
        Problem(
            rule=Rule.UNGATHERED_USE,
            op_index=1,
            site="event",
            message="pre_forward of unit 1: unit 1's forward runs but its all-gather is not awaited",
        )
    ]
    assert str(found[0]).startswith("[ungathered_use] event 1: pre_forward of unit 1:")


# -- validation -------------------------------------------------------------------------------------


def _request(**changes: object) -> UnshardRequest:
    fields: dict[str, object] = {
        "units": 3,
        "root": 0,
        "forward_order": (0, 1, 2),
        "backward_order": (0, 2, 1),
        "reshard_after_forward": True,
        "plan_reshards": True,
        "reshard_at_end_of_backward": True,
    }
    fields.update(changes)
    return UnshardRequest(**fields)  # type: ignore[arg-type]  # deliberately ill-typed values


@pytest.mark.parametrize(
    ("changes", "error", "fragment"),
    [
        ({"units": 0}, ValueError, "units"),
        ({"units": True}, TypeError, "units"),
        ({"root": 3}, ValueError, "root"),
        ({"root": "0"}, TypeError, "root"),
        ({"forward_order": [0, 1, 2]}, TypeError, "forward_order"),
        ({"forward_order": (0, 3)}, ValueError, "forward_order"),
        ({"forward_order": (0, 0)}, ValueError, "forward_order"),
        ({"backward_order": (0, False)}, ValueError, "backward_order"),
        ({"reshard_after_forward": 1}, TypeError, "reshard_after_forward"),
        ({"plan_reshards": None}, TypeError, "plan_reshards"),
        ({"reshard_at_end_of_backward": 0}, TypeError, "reshard_at_end_of_backward"),
        ({"forward_prefetch": "yes"}, TypeError, "forward_prefetch"),
        ({"backward_prefetch": "BACKWARD_PRE"}, TypeError, "backward_prefetch"),
    ],
)
def test_bad_requests_fail_naming_the_field(changes: dict[str, object], error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        _request(**changes)


def test_bad_schedules_fail_on_construction() -> None:
    req = _request()
    with pytest.raises(ValueError, match="not an event of the recorded orders"):
        UnshardSchedule(
            request=req,
            steps=(
                UnshardStep(event=E.POST_FORWARD, unit=0, actions=()),
                UnshardStep(event=E.PRE_BACKWARD, unit=5, actions=()),
            ),
        )
    step = UnshardStep(event=E.PRE_FORWARD, unit=1, actions=(g(1), a(1)))
    with pytest.raises(ValueError, match="appears twice"):
        UnshardSchedule(request=req, steps=(step, step))
    with pytest.raises(ValueError, match="gather of unit 7"):
        UnshardSchedule(request=req, steps=(replace(step, actions=(g(7),)),))
    with pytest.raises(TypeError, match="actions"):
        UnshardStep(event=E.PRE_FORWARD, unit=1, actions=[g(1)])  # type: ignore[arg-type]  # a list, not a tuple
    with pytest.raises(ValueError, match=r"Gather\.unit"):
        Gather(unit=-1)
    with pytest.raises(TypeError, match=r"Reshard\.unit"):
        Reshard(unit=1.0)  # type: ignore[arg-type]  # not an int


def test_backward_prefetch_parse() -> None:
    assert BackwardPrefetch.parse("backward_pre") is PRE
    assert BackwardPrefetch.parse(" Backward-Post ") is POST
    accepted = "accepted: BACKWARD_PRE, BACKWARD_POST"
    with pytest.raises(ValueError, match=f"backward_prefetch: unknown value 'pre'; {accepted}"):
        BackwardPrefetch.parse("pre")


def test_format_lists_every_step() -> None:
    text = format_unshard(plan_unshard(chain()))
    lines = text.splitlines()
    assert lines[0] == "all-gather schedule: 4 unit(s), root 0; backward_prefetch BACKWARD_PRE, forward_prefetch False"
    assert "forward order: 0 1 2 3; backward order: 0 3 2 1" in lines[2]
    assert "pre_backward   3     await 3, gather 2" in text
    assert "post_forward   0     -" in text
    assert len([line for line in lines if line.split()[:1] and line.split()[0].isdigit()]) == 16


# -- property: the planner's schedules are sound -----------------------------------------------------


@st.composite
def requests(draw: st.DrawFn) -> UnshardRequest:
    units = draw(st.integers(1, 8))
    root = draw(st.integers(0, units - 1))
    forward = draw(st.permutations(range(units)).flatmap(lambda p: st.integers(0, units).map(lambda k: tuple(p[:k]))))
    backward = draw(st.permutations(range(units)).flatmap(lambda p: st.integers(0, units).map(lambda k: tuple(p[:k]))))
    return UnshardRequest(
        units=units,
        root=root,
        forward_order=forward,
        backward_order=backward,
        reshard_after_forward=draw(st.booleans()),
        plan_reshards=draw(st.booleans()),
        reshard_at_end_of_backward=draw(st.booleans()),
        backward_prefetch=draw(st.sampled_from([None, PRE, POST])),
        forward_prefetch=draw(st.booleans()),
    )


@budget(300)
@given(requests())
def test_planned_schedules_check_clean(req: UnshardRequest) -> None:
    schedule = plan_unshard(req)
    assert check_unshard(schedule) == []
    assert plan_unshard(req) == schedule
    assert [(s.event, s.unit) for s in schedule.steps] == list(req.events)
    # Forward and backward prefetch are applied wherever FSDP1 applies them.
    if req.forward_prefetch:
        for unit in req.forward_order[1:]:
            assert g(unit) not in schedule.actions(E.PRE_FORWARD, unit)
    if req.backward_prefetch is PRE:
        for unit in req.backward_order[1:]:
            assert g(unit) not in schedule.actions(E.PRE_BACKWARD, unit)


@budget(80)
@given(st.integers(1, 12), st.sampled_from([None, PRE, POST]), st.booleans())
def test_a_full_shard_chain_holds_at_most_two_units_besides_the_root(
    units: int, prefetch: BackwardPrefetch | None, forward_prefetch: bool
) -> None:
    req = chain(units=units, prefetch=prefetch, forward_prefetch=forward_prefetch)
    schedule = plan_unshard(req)
    held: set[int] = set()
    most = 0
    for event, unit in req.events:
        if event is E.POST_BACKWARD:
            held.discard(unit)  # the post-backward plan reshards
        for action in schedule.actions(event, unit):
            if isinstance(action, Reshard):
                held.discard(action.unit)
            else:
                held.add(action.unit)
            most = max(most, len(held - {req.root}))
    expected = 2 if units >= 3 and (prefetch is PRE or forward_prefetch) else min(units - 1, 1)
    assert most == expected
