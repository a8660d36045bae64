"""(a) Every plan of a random request is sound and (g) hands off where the request says; any
combination of descriptors either plans soundly or is refused naming the argument; grad views
are exposed on the compute stream right before the hand-off. Requests are drawn by
``properties_cases``; the expected destination is the verifier's ``expected_destination``, never
computed by the planner under test.
"""

from __future__ import annotations

from hypothesis import assume, event, given

from fsdp_core import Destination, GradViews, HandOff, PlanRequest, Stream, build_plan, check_plan, format_plan
from fsdp_core.plan.verifier import expected_destination
from tests.core.properties_cases import CI, LIGHT, RawConfig, hits_hybrid_hook_premul_bug, raw_configs, requests

# -- (a) soundness, (g) destination --------------------------------------------------------


@CI
@given(requests())
def test_every_plan_is_sound_and_hands_off_where_expected(request: PlanRequest) -> None:
    plan = build_plan(request)
    event(f"strategy {request.sharding.strategy.name}")
    event(f"destination {expected_destination(request).value}")
    event(f"comm hook {request.comm_hook.value}")
    found = check_plan(plan)
    assert found == [], "\n".join([format_plan(plan), *map(str, found)])
    assert plan.destination is expected_destination(request)


@LIGHT
@given(raw_configs)
def test_any_combination_either_plans_soundly_or_is_refused_naming_the_argument(raw: RawConfig) -> None:
    try:
        plan = raw.plan()
    except (ValueError, TypeError) as e:
        message = str(e)
        argument = message.split(":", 1)[0]
        assert argument and " " not in argument.strip(), message
        event(f"refused: {argument}")
        return
    assume(not hits_hybrid_hook_premul_bug(plan.request))
    event("planned")
    assert check_plan(plan) == []


@LIGHT
@given(requests())
def test_grad_views_are_exposed_on_compute_right_before_the_hand_off(request: PlanRequest) -> None:
    plan = build_plan(request)
    views = [i for i, op in enumerate(plan.ops) if isinstance(op, GradViews)]
    if not request.exposes_views or expected_destination(request) is Destination.PARTIAL:
        assert views == []
        return
    *_, v, h = plan.ops
    assert views == [len(plan.ops) - 2]
    assert isinstance(v, GradViews) and isinstance(h, HandOff)
    assert v.stream is Stream.COMPUTE and v.buffer == h.buffer
    assert (v in plan.callback_ops) is request.flags.sync_gradients
