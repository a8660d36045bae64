"""Ranks whose forwards skip different wrapped units, or leave a unit's output unused, neither
hang nor train wrong with ``ranks_may_diverge=True``: every rank runs the same FSDP events
(``fsdp_shell.safety.sequencer``), the unit a rank did not use contributing a zero gradient there, as in
the single-process reference. Without it, paths whose collectives pair wrongly but complete are
caught at the end of backward on every rank."""

from __future__ import annotations

from fsdp_core import ShardingStrategy
from tests.worlds.dist_harness import run_world
from tests.worlds.divergence_cases import Divergence, gives_up_by_default, run_divergences, undetected_by_default

F = frozenset
TOL = 1e-6

TWO_RANKS = (
    Divergence("same-path", skip=(F(),)),
    Divergence("one-rank-skips-a-middle-unit", skip=(F(), F({1}))),
    Divergence("one-rank-skips-the-last-unit", skip=(F(), F({3}))),
    Divergence("ranks-skip-different-units-orig", skip=(F({0}), F({2, 3})), use_orig_params=True),
    Divergence("one-rank-leaves-an-output-unused", skip=(F(),), unused=(F(), F({2}))),
    Divergence("unused-output-orig", skip=(F(),), unused=(F({1}), F()), use_orig_params=True),
    Divergence("grad-op-skip", skip=(F(), F({1})), strategy=ShardingStrategy.SHARD_GRAD_OP),
    Divergence("no-shard-skip", skip=(F(), F({0})), strategy=ShardingStrategy.NO_SHARD),
)

FOUR_RANKS = (
    Divergence("hybrid-skip", skip=(F(), F({1}), F(), F({2, 3})), strategy=ShardingStrategy.HYBRID_SHARD),
    Divergence(
        "hybrid-zero2-unused-orig",
        skip=(F(),),
        unused=(F(), F(), F({0}), F()),
        strategy=ShardingStrategy.HYBRID_SHARD_ZERO2,
        use_orig_params=True,
    ),
)


def _check(cases: tuple[Divergence, ...], world: int) -> None:
    for outcomes in run_world(world, run_divergences, cases, timeout=150, fresh=True):
        assert set(outcomes) == {c.name for c in cases}
        for name, (diff, agreements) in outcomes.items():
            assert diff <= TOL, (name, diff)
            assert agreements > 0, name


def test_divergent_paths_on_two_ranks_match_the_reference() -> None:
    _check(TWO_RANKS, 2)


def test_divergent_paths_with_hybrid_sharding_on_four_ranks_match_the_reference() -> None:
    _check(FOUR_RANKS, 4)


def test_without_ranks_may_diverge_paths_that_pair_wrongly_raise_on_every_rank() -> None:
    messages = run_world(2, undetected_by_default, None, timeout=120, fresh=True)
    assert all("ranks ran different FSDP units" in m and "ranks_may_diverge=True" in m for m in messages), messages
    assert messages[0] == messages[1]


def test_without_ranks_may_diverge_a_rank_left_waiting_raises_on_every_rank_at_the_timeout() -> None:
    for skipped in (F({1}), F({3})):
        messages = run_world(2, gives_up_by_default, skipped, timeout=90, fresh=True)
        for rank, message in enumerate(messages):
            assert f"rank {rank} gave up waiting for the other ranks" in message, (skipped, messages)
            assert "pass ranks_may_diverge=True" in message, (skipped, messages)
