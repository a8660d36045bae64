"""The prediction against measurement: what ``predict_memory`` says each rank will hold, from
the model built on the meta device and no process group, equals what the rank holds when it
trains on a real gloo world (``LiveBytes``: exact live tensor-storage bytes), to the byte, for
the peak of every phase and the bytes left after the last step, on every rank.

A few configurations spanning the strategies, bf16, ``use_orig_params``, ``no_sync``, offload,
prefetch, optimizers and models; ``python benchmarks/bench_predict.py`` runs 30.
"""

from __future__ import annotations

import pytest

from benchmarks.bench_predict import CONFIGS, compare

CASES = [
    "mlp-full_shard-orig-bf16-no_sync",
    "mlp-shard_grad_op-bf16-no_sync",
    "mlp-hybrid_shard-sync-no_sync",
    "mlp-full_shard-offload-bf16-orig",
    "mlp-full_shard-no_prefetch-forward_prefetch",
    "demo-full_shard",
    "gpt2-full_shard-bf16-orig",
    "llama-hybrid_shard_zero2-orig-sgd_momentum",
]


@pytest.mark.parametrize("name", CASES)
def test_predicted_bytes_are_the_measured_ones(name: str) -> None:
    for rank, (predicted, measured) in enumerate(compare(CONFIGS[name], steps=2)):
        assert predicted == measured, f"rank {rank}"
