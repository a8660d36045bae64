"""(h) Gradient state carried between backwards: from nothing carried, any sequence of
synchronising, ``no_sync`` and deferring backwards takes only carried buffers, overwrites none, and
carries what is worked out here by hand. Requests are drawn by ``properties_cases``. Expected
values are written out here, never computed with the function under test.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from hypothesis import event, given
from hypothesis import strategies as st

from fsdp_core import InputRole, PlanRequest, StepFlags, build_plan, carried_role, check_plan, format_plan, step_flags
from tests.core.properties_cases import LIGHT, requests

# -- (h) gradient state carried between backwards -------------------------------------------

SHARDED, PENDING, PARTIAL = InputRole.SHARDED_GRAD, InputRole.PENDING_UNSHARDED, InputRole.PENDING_PARTIAL
Step = Literal["sync", "no_sync", "defer"]
"""One backward: ``"sync"``, ``"no_sync"`` or (hybrid only) ``"defer"`` (``requires_all_reduce=False``)."""


def expected_consumed(carried: frozenset[InputRole], step: Step) -> frozenset[InputRole]:
    """By hand: a synchronising backward folds everything in; ``no_sync`` only adds to the pending
    unsharded gradient; deferring folds in all but the sharded gradient, which waits for an all-reduce."""
    if step == "no_sync":
        return carried & {PENDING}
    if step == "defer":
        return carried - {SHARDED}
    return carried


def expected_carried(carried: frozenset[InputRole], step: Step) -> frozenset[InputRole]:
    """By hand: what is carried out of a backward that started with ``carried``."""
    if step == "no_sync":
        return carried | {PENDING}
    if step == "defer":
        return (carried - {PENDING}) | {PARTIAL}
    return frozenset({SHARDED})


def declared(flags: StepFlags) -> frozenset[InputRole]:
    """The carried roles ``flags`` say exist."""
    pairs = ((SHARDED, flags.accumulate), (PENDING, flags.pending_unsharded), (PARTIAL, flags.pending_partial))
    return frozenset(role for role, present in pairs if present)


@st.composite
def backward_sequences(draw: st.DrawFn) -> tuple[PlanRequest, list[Step]]:
    """A request (its flags replaced at every step) and one to eight backwards."""
    request = draw(requests())
    kinds: list[Step] = ["sync", "no_sync", "defer"] if request.sharding.strategy.is_hybrid else ["sync", "no_sync"]
    return request, draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=8))


@LIGHT
@given(backward_sequences())
def test_carried_state_threads_through_any_sequence_of_backwards(sequence: tuple[PlanRequest, list[Step]]) -> None:
    """From nothing carried, every backward's flags come from the carried set alone, its plan is
    sound, takes only carried buffers, leaves its hand-off under a role no untaken buffer holds
    (so none is overwritten), and the next carried set is the one worked out by hand."""
    base, steps = sequence
    carried: frozenset[InputRole] = frozenset()
    for step in steps:
        flags = step_flags(
            carried,
            sync_gradients=step != "no_sync",
            requires_all_reduce=step != "defer",
            force_full_precision=base.flags.force_full_precision,
        )
        assert declared(flags) == carried
        plan = build_plan(dataclasses.replace(base, flags=flags))
        found = check_plan(plan)
        assert found == [], "\n".join([format_plan(plan), *map(str, found)])
        assert plan.consumed == expected_consumed(carried, step)
        kept = carried - plan.consumed
        assert plan.destination is not None and plan.carried_out is carried_role(plan.destination)
        assert plan.carried_out not in kept
        after = kept | {plan.carried_out}
        assert carried <= plan.consumed | after
        assert after == expected_carried(carried, step)
        event(f"{step} from {sorted(r.value for r in carried)}")
        carried = after
