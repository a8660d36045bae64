"""Every ``check_unshard`` rule on a broken schedule: one broken variant of the sound schedule of
``chain()`` (``BACKWARD_PRE``, written out by hand in ``test_unshard_schedules.py``) per rule,
each with the rules and event indices it must report worked out by hand.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_core import Event, Problem, Rule, UnshardAction, UnshardRequest, UnshardSchedule, check_unshard, plan_unshard
from tests.core.unshard_cases import E, a, chain, g, r

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
