"""The all-gather schedule's descriptors refuse bad values on construction, naming the field;
``BackwardPrefetch.parse``; the schedule's text, step by step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fsdp_core import (
    BackwardPrefetch,
    Gather,
    Reshard,
    UnshardRequest,
    UnshardSchedule,
    UnshardStep,
    format_unshard,
    plan_unshard,
)
from tests.core.unshard_cases import POST, PRE, E, a, chain, g

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
        ({"forward_reshards": (True, True)}, ValueError, r"forward_reshards: expected one bool per unit \(3\), got 2"),
        ({"forward_reshards": (1, 0, 1)}, TypeError, "forward_reshards: expected a tuple of bools"),
        ({"forward_reshards": [True, True, True]}, TypeError, "forward_reshards"),
        ({"backward_reshards": (True,)}, ValueError, r"backward_reshards: expected one bool per unit \(3\), got 1"),
        ({"backward_gathers": (True, "no", True)}, TypeError, "backward_gathers: expected a tuple of bools"),
        ({"forward_prefetches": ((1,), ())}, ValueError, r"forward_prefetches: expected one tuple per unit \(3\)"),
        ({"forward_prefetches": ((1,), [2], ())}, TypeError, "forward_prefetches: expected a tuple of unit tuples"),
        (
            {"backward_prefetches": ((), (1,), ())},
            ValueError,
            r"backward_prefetches\[1\]: a unit cannot",
        ),
        (
            {"backward_prefetches": ((3,), (), ())},
            ValueError,
            r"backward_prefetches\[0\]: expected unit",
        ),
        ({"forward_prefetches": ((1, 1), (), ())}, ValueError, r"forward_prefetches\[0\]: every unit may appear once"),
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
