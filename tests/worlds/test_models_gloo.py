"""Real models and real training habits on gloo worlds, against single-process references.

Hugging Face GPT-2 (its ``lm_head.weight`` tied to ``transformer.wte.weight``) and Llama (GQA,
non-persistent RoPE buffers) in tiny configurations, every strategy that fits the world, flat
and ``use_orig_params``; sharded checkpoints saved with ``torch.distributed.checkpoint`` on one
world size and loaded on others; and what training scripts do (tied weights, frozen units,
LoRA-style frozen weights, activation checkpointing, two forwards per backward, eval and
no-grad forwards, dataclass and dict outputs, keyword-only inputs, fp16 with
``ShardedGradScaler``).
"""

from __future__ import annotations

import pytest

from fsdp_core import ShardingStrategy
from tests.worlds.dist_harness import run_world
from tests.worlds.habit_cases import HABITS, run_habits, scaler_steps

TOL = 1e-5
FLAT = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)
HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


def test_training_habits_match_the_reference() -> None:
    results = run_world(2, run_habits, HABITS, timeout=280)
    for rank_result in results:
        assert set(rank_result) == {h.name for h in HABITS}
        bad = {name: diff for name, diff in rank_result.items() if not diff <= TOL}
        assert not bad, bad


def test_sharded_grad_scaler_skips_an_inf_step_on_every_rank() -> None:
    for result in run_world(2, scaler_steps, None, timeout=100):
        assert result["inf_changed"] == 0.0
        assert result["inf_scale"] == 512.0
        assert result["finite_changed"] > 0.0
        assert result["finite_scale"] == 512.0


transformers = pytest.importorskip("transformers")

from tests.worlds.hf_cases import ModelCase, ModelOutcome, SaveCase, dcp_load, dcp_save, run_model_cases  # noqa: E402


def _check(outcomes: dict[str, ModelOutcome]) -> None:
    for name, o in outcomes.items():
        assert o.max_diff <= TOL, (name, o)
        assert o.keys_match, name
        assert o.loaded_diff == 0.0, (name, o)
        assert o.missing == [] and o.unexpected == [], (name, o)
        assert o.tied, name
        assert o.optim_diff <= TOL, (name, o)
        assert o.optim_reloaded_diff == 0.0, (name, o)


def test_gpt2_and_llama_train_as_the_reference_on_two_ranks() -> None:
    cases = tuple(ModelCase(kind, s, o) for kind in ("gpt2", "llama") for s in FLAT for o in (False, True))
    for outcomes in run_world(2, run_model_cases, cases, timeout=380):
        assert set(outcomes) == {c.name for c in cases}
        _check(outcomes)


def test_gpt2_and_llama_train_as_the_reference_hybrid_on_four_ranks() -> None:
    cases = tuple(ModelCase(kind, s, o) for kind in ("gpt2", "llama") for s in HYBRID for o in (False, True))
    for outcomes in run_world(4, run_model_cases, cases, timeout=380):
        assert set(outcomes) == {c.name for c in cases}
        _check(outcomes)


@pytest.mark.parametrize(
    ("kind", "strategy", "save_world"),
    [
        ("gpt2", ShardingStrategy.FULL_SHARD, 2),
        ("llama", ShardingStrategy.HYBRID_SHARD, 4),
    ],
)
def test_sharded_checkpoint_saved_on_one_world_loads_on_others(
    tmp_path: object, kind: str, strategy: ShardingStrategy, save_world: int
) -> None:
    save = SaveCase(kind=kind, strategy=strategy, path=str(tmp_path))
    saved = run_world(save_world, dcp_save, save, timeout=120)[0]
    for world in (1, 3):
        for diff in run_world(world, dcp_load, (save, saved), timeout=120):
            assert diff == 0.0, (world, diff)
