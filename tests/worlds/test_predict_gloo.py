"""The prediction against measurement: what ``predict_memory`` says each rank will hold, from
the model built on the meta device and no process group, equals what the rank holds when it
trains on a real gloo world (``LiveBytes``: exact live tensor-storage bytes), to the byte, for
the peak of every phase and the bytes left after the last step, on every rank.

A few configurations spanning the strategies, bf16, ``use_orig_params``, ``no_sync``, offload,
prefetch, optimizers and models (``fsdp_shell.predict.against.compare``, the same as
``python benchmarks/bench_predict.py`` runs on 30).
"""

from __future__ import annotations

import pytest

from fsdp_shell.memory.workload import Config
from fsdp_shell.predict.against import compare

CASES = {
    "mlp-full_shard-orig-bf16-no_sync": Config("FULL_SHARD", orig=True, bf16=True, accumulate=2),
    "mlp-shard_grad_op-bf16-no_sync": Config("SHARD_GRAD_OP", bf16=True, accumulate=3),
    "mlp-hybrid_shard-sync-no_sync": Config("HYBRID_SHARD", hybrid_all_reduce="sync", accumulate=2),
    "mlp-full_shard-offload-bf16-orig": Config("FULL_SHARD", offload=True, bf16=True, orig=True),
    "mlp-full_shard-no_prefetch-forward_prefetch": Config(
        "FULL_SHARD", backward_prefetch="none", forward_prefetch=True
    ),
    "mlp-full_shard-orig-bf16-sync_every_micro3": Config(
        "FULL_SHARD", orig=True, bf16=True, accumulate=3, sync_every_micro=True
    ),
    "demo-full_shard": Config("FULL_SHARD", model="demo"),
    "gpt2-full_shard-bf16-orig": Config("FULL_SHARD", model="gpt2", bf16=True, orig=True),
    "llama-hybrid_shard_zero2-orig-sgd_momentum": Config(
        "HYBRID_SHARD_ZERO2", model="llama", orig=True, optimizer="sgd_momentum"
    ),
}


FULLY_SHARD_CASES = {
    "mlp-no_sync": Config("FULL_SHARD", accumulate=2),
    "mlp-hpz2-bf16-no_sync": Config("FULL_SHARD", ranks=4, reshard_after_forward=2, bf16=True, accumulate=2),
    "mlp-hsdp-no_reshard-bf16": Config("HYBRID_SHARD_ZERO2", bf16=True),
    "demo-hsdp-bf16-no_sync": Config("HYBRID_SHARD", model="demo", bf16=True, accumulate=2),
    "gpt2-3ranks": Config("FULL_SHARD", model="gpt2", ranks=3),
    "mlp-prefetch-hpz2-bf16": Config("FULL_SHARD", ranks=4, explicit_prefetch=True, reshard_after_forward=2, bf16=True),
    "mlp-sync_every_micro": Config("FULL_SHARD", accumulate=2, sync_every_micro=True),
}
"""``fully_shard`` on every block, then the root (``predict_memory(..., api="fully_shard")``):
kept ``no_sync`` gradients restored into ``.grad`` (fp32) or carried in the reduce dtype (bf16),
hpZ, HSDP without resharding, uneven shards with tied embeddings, explicit prefetch lists."""


@pytest.mark.parametrize("name", list(CASES))
def test_predicted_bytes_are_the_measured_ones(name: str) -> None:
    for rank, (predicted, measured) in enumerate(compare(CASES[name], steps=2)):
        assert predicted == measured, f"rank {rank}"


@pytest.mark.parametrize("name", list(FULLY_SHARD_CASES))
def test_fully_shards_predicted_bytes_are_the_measured_ones(name: str) -> None:
    for rank, (predicted, measured) in enumerate(compare(FULLY_SHARD_CASES[name], steps=2, api="fully_shard")):
        assert predicted == measured, f"rank {rank}"
