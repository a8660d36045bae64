"""Ranks that disagree fail together with one clear error; a failed step leaves the wrapper usable."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worlds.dist_harness import run_world
from tests.worlds.fault_cases import mismatches, mixed_layouts, on_a_subgroup, recovery

ROOT = Path(__file__).resolve().parents[2]


def test_ranks_that_disagree_raise_the_same_error_before_any_collective() -> None:
    results = run_world(2, mismatches, None, timeout=120, fresh=True)
    for field, fragment in (
        ("mixed_precision", "ranks disagree on mixed_precision"),
        ("wrap_policy", "ranks disagree on number of FSDP units"),
        ("strategy", "ranks disagree on sharding_strategy"),
        ("comm_hook", "ranks disagree on comm hook"),
    ):
        messages = [r[field] for r in results]
        assert isinstance(messages[0], str) and fragment in messages[0], (field, messages)
        assert messages[0] == messages[1], (field, messages)  # the same error on every rank
        assert "rank 0:" in messages[0] and "rank 1:" in messages[0]
    guide = (ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8")
    assert f"\nRankMismatchError: {results[0]['mixed_precision']}\n" in guide, "the user guide quotes the error"
    wrap = results[0]["wrap_policy"]
    assert isinstance(wrap, str) and wrap.endswith(
        "rank 0: 3; rank 1: 7. Build the model and FSDP with the same arguments on every rank"
    )
    for r in results:
        seconds = r["agreement_seconds"]
        assert isinstance(seconds, float) and 0 < seconds < 5


def test_hybrid_groups_from_different_layouts_are_refused_on_every_rank() -> None:
    messages = run_world(4, mixed_layouts, None, timeout=120, fresh=True)
    assert all("every rank must pass groups from one layout" in m for m in messages), messages
    assert len(set(messages)) == 1


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig-params"])
def test_a_step_that_fails_in_the_loss_or_a_hook_leaves_the_wrapper_usable(use_orig_params: bool) -> None:
    for diff in run_world(2, recovery, use_orig_params, timeout=120, fresh=True):
        assert diff <= 1e-6


def test_fsdp_on_a_subgroup_needs_nothing_from_the_other_ranks() -> None:
    assert run_world(4, on_a_subgroup, None, timeout=120, fresh=True) == ["trained", "trained", "idle", "idle"]
