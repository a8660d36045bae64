"""Bad configuration fails at construction, naming the argument; torch's config objects work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_shell import FSDP
from tests.worlds.dist_harness import run_world
from tests.worlds.fsdp_config_cases import bad_configurations, torch_config_objects

EXPECTED = {
    "hybrid-pair-same-group": ("ValueError", "process_group"),
    "hybrid-pair-not-tiling": ("ValueError", "must tile the world"),
    "hook-signature": ("TypeError", "hook: FULL_SHARD calls hook(state, grad, output)"),
    "hook-twice": ("ValueError", "already registered"),
    "hook-after-forward": ("ValueError", "before the first forward"),
    "clip-negative": ("ValueError", "max_norm"),
    "clip-nan": ("ValueError", "max_norm"),
    "clip-norm-type-negative": ("ValueError", "norm_type"),
    "clip-norm-type-string": ("TypeError", "norm_type"),
    "device-id-without-cuda": ("ValueError", "device_id"),
    "no-parameters": ("ValueError", "no parameters"),
    "ranks-may-diverge-type": ("TypeError", "ranks_may_diverge"),
    "wrap-policy-bare-class": ("TypeError", "auto_wrap_policy"),
    "strategy": ("ValueError", "sharding_strategy"),
    "hybrid-without-groups": ("ValueError", "process_group"),
    "pair-for-flat": ("ValueError", "process_group"),
    "pg-and-mesh": ("ValueError", "process_group, device_mesh"),
    "buffer-dtype": ("TypeError", "mixed_precision.buffer_dtype"),
    "limit-all-gathers-type": ("TypeError", "limit_all_gathers"),
    "ignored-not-iterable": ("TypeError", "ignored_modules"),
    "mp-string": ("TypeError", "mixed_precision"),
    "wrap-policy": ("TypeError", "auto_wrap_policy"),
    "device-id": ("TypeError", "device_id"),
    "use-orig-params": ("TypeError", "use_orig_params"),
    "shared-across-units": ("ValueError", "shared across FSDP units"),
    "frozen-beside-trainable-flat": ("ValueError", "use_orig_params=True"),
    "state-dict-type": ("ValueError", "LOCAL_STATE_DICT"),
    "state-dict-type-local": ("ValueError", "LOCAL_STATE_DICT"),
    "state-dict-config": ("ValueError", "rank0_only"),
    "load-int-into-float": ("TypeError", "state_dict['weight']"),
    "load-list": ("TypeError", "state_dict['weight']"),
    "load-missing-strict": ("RuntimeError", 'Missing key(s) in state_dict: "bias"'),
    "mixed-dtypes": ("ValueError", "dtype"),
    "hook-with-reduce-dtype": ("ValueError", "comm_hook"),
    "not-a-module": ("TypeError", "module"),
    "division-policy": ("ValueError", "division_policy"),
    "divide-factor-zero": ("ValueError", "divide_factor"),
    "divide-factor-string": ("TypeError", "factor"),
    "divide-factor-with-hook": ("ValueError", "communication hook"),
    "sync-all-reduce-flat": ("ValueError", "hybrid_all_reduce"),
    "all-reduce-placement-type": ("TypeError", "hybrid_all_reduce"),
    "all-reduce-placement-name": ("ValueError", "hybrid_all_reduce"),
}


def test_bad_configurations_fail_at_construction() -> None:
    (errors, _) = run_world(2, bad_configurations, None, timeout=300)
    assert set(errors) == set(EXPECTED)
    for name, (kind, fragment) in EXPECTED.items():
        assert errors[name].startswith(kind + ":"), f"{name}: {errors[name]}"
        assert fragment in errors[name], f"{name}: {errors[name]}"


def test_torch_config_objects_are_accepted() -> None:
    (out, _) = run_world(2, torch_config_objects, None, timeout=300)
    assert out == {
        "strategy": "SHARD_GRAD_OP",
        "out_dtype": "torch.bfloat16",
        "units": "3",
        "none_strategy": "FULL_SHARD",
    }


def test_needs_an_initialised_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        FSDP(nn.Linear(2, 2))
    assert not torch.distributed.is_initialized()
