"""The verifier's baselines: sound plans produce no problems at all (or every finding of the other
``test_verifier_*.py`` modules would be noise), a problem reads as one line naming its buffer,
every ``Rule`` is exercised by some test, and the verifying plan cache refuses unsound plans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fsdp_core import (
    AllReduce,
    CommHook,
    Free,
    MixedPrecision,
    Plan,
    PlanCache,
    RecordStream,
    Rule,
    StepFlags,
    UnsoundPlanError,
)
from tests.core.verifier_cases import (
    FULL,
    HYBRID,
    HYBRID2,
    MULTI,
    NCCL_AVG,
    NO_SHARD,
    ZERO2,
    drop,
    find,
    is_buffer,
    make_plan,
    problems,
    war_plan,
)

# -- sound baselines -----------------------------------------------------------------------

SOUND: dict[str, Callable[[], Plan]] = {
    "full_shard": lambda: make_plan(FULL),
    "shard_grad_op": lambda: make_plan(ZERO2),
    "no_shard": lambda: make_plan(NO_SHARD),
    "hybrid": lambda: make_plan(HYBRID),
    "hybrid_zero2": lambda: make_plan(HYBRID2),
    "hybrid_accumulate": lambda: make_plan(HYBRID, flags=StepFlags(accumulate=True)),
    "hybrid_bf16": lambda: make_plan(HYBRID, mp=MixedPrecision(param_dtype=torch.bfloat16)),
    "hybrid_deferred": lambda: make_plan(HYBRID, flags=StepFlags(requires_all_reduce=False)),
    "hybrid_pending_partial": lambda: make_plan(HYBRID, flags=StepFlags(pending_partial=True)),
    "full_shard_fp16_offload_orig": lambda: make_plan(
        FULL, layout=MULTI, mp=MixedPrecision(param_dtype=torch.float16), offload=True, use_orig_params=True
    ),
    "full_shard_offload_accumulate": lambda: make_plan(FULL, offload=True, flags=StepFlags(accumulate=True)),
    "full_shard_nccl_avg": lambda: make_plan(FULL, division=NCCL_AVG),
    "full_shard_user_factor": lambda: make_plan(FULL, division=dataclasses.replace(NCCL_AVG, factor=3.0)),
    "full_shard_hook": lambda: make_plan(FULL, hook=CommHook.FP16_COMPRESS),
    "hybrid_hook": lambda: make_plan(HYBRID, hook=CommHook.BF16_COMPRESS),
    "no_shard_hook": lambda: make_plan(NO_SHARD, hook=CommHook.ALLREDUCE),
    "no_sync": lambda: make_plan(FULL, flags=StepFlags(sync_gradients=False)),
    "no_sync_pending": lambda: make_plan(ZERO2, flags=StepFlags(sync_gradients=False, pending_unsharded=True)),
    "pending_unsharded": lambda: make_plan(FULL, flags=StepFlags(pending_unsharded=True, accumulate=True)),
    "hybrid_orig_params": lambda: make_plan(HYBRID, layout=MULTI, use_orig_params=True),
    "orig_params_rank3": lambda: make_plan(FULL, layout=MULTI, rank=3, use_orig_params=True),
}


@pytest.mark.parametrize("name", sorted(SOUND))
def test_sound_baselines_have_no_problems(name: str) -> None:
    assert problems(SOUND[name]()) == []


def test_hand_written_plan_is_sound() -> None:
    assert problems(war_plan(with_hazard=False)) == []


# -- problem rendering ---------------------------------------------------------------------


def test_problem_str_is_readable_and_names_the_buffer() -> None:
    plan = make_plan(HYBRID, flags=StepFlags(accumulate=True))
    broken = drop(plan, find(plan, RecordStream, lambda op: op.buffer.name == "shard"))
    [p] = problems(broken)
    text = str(p)
    assert text.startswith(f"[unsafe_reuse] op {p.op_index}: shard ")
    assert "all_reduce" in text and "post_backward" in text
    assert "\n" not in text

    leak = drop(plan, find(plan, Free, is_buffer("grad.padded")))
    [q] = problems(leak)
    assert str(q) == "[leak] plan: grad.padded is neither freed nor handed off"


def test_every_rule_is_exercised() -> None:
    """Every Rule the verifiers can report appears in at least one test: ``check_plan``'s in the
    ``test_verifier_*.py`` modules, ``check_unshard``'s in ``test_unshard_checker.py``."""
    here = Path(__file__).parent
    modules = [*sorted(here.glob("test_verifier_*.py")), here / "test_unshard_checker.py"]
    source = "".join(path.read_text(encoding="utf-8") for path in modules)
    missing = [r.name for r in Rule if f"Rule.{r.name}" not in source]
    assert missing == []


# -- gaps found while writing these tests, since closed ---------------------------------------------------


def test_verifying_cache_checks_each_plan_once_and_refuses_unsound_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the shell consults on every backward: a miss builds and verifies, a hit returns the
    same plan; a plan the verifier rejects raises with its problems instead of being returned."""
    import fsdp_core.plan.planner as planner

    plan = make_plan(HYBRID)
    cache = PlanCache(verify=True)
    assert cache(plan.request) is cache(plan.request) and (cache.misses, cache.hits) == (1, 1)

    broken = dataclasses.replace(plan, ops=drop(plan, find(plan, AllReduce)).ops)
    monkeypatch.setattr(planner, "build_plan", lambda request: broken)
    with pytest.raises(UnsoundPlanError) as caught:
        PlanCache(verify=True)(plan.request)
    assert caught.value.plan is broken
    assert any(p.rule is Rule.REDUCTION for p in caught.value.problems)
    assert PlanCache()(plan.request) is broken
