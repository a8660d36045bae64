"""The planner's all-gather schedules check clean for random records and apply prefetch wherever
FSDP1 applies it; a full-shard chain holds at most two units besides the root.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fsdp_core import BackwardPrefetch, Reshard, UnshardRequest, check_unshard, plan_unshard
from tests.budget import budget
from tests.core.unshard_cases import POST, PRE, E, chain, g

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
        forward_reshards=draw(st.one_of(st.just(()), st.tuples(*[st.booleans()] * units))),  # fully_shard's
        backward_reshards=draw(st.one_of(st.just(()), st.tuples(*[st.booleans()] * units))),
        backward_gathers=draw(st.one_of(st.just(()), st.tuples(*[st.booleans()] * units))),
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
