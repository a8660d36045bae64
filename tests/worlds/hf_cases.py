"""Hugging Face GPT-2 (tied embeddings) and Llama (GQA, RoPE buffers) on gloo worlds.

Tiny configurations built in code with random weights (nothing downloads:
``fsdp_shell.memory.workload.hf_model``). Each case trains
``STEPS`` SGD-with-momentum steps and compares every state-dict entry with a single-process
reference trained on all ranks' batches; it also checks the state dict's keys against the
unwrapped model's and loads the reference's own ``state_dict()`` back.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load_into
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save_from
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import GPT2LMHeadModel

from fsdp_core import ShardingStrategy
from fsdp_shell import FSDP, StateDictType
from fsdp_shell.memory.workload import HF_VOCAB, hf_model

STEPS = 3


@dataclass(frozen=True)
class ModelCase:
    kind: str
    strategy: ShardingStrategy
    use_orig_params: bool

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.strategy.name}-orig{self.use_orig_params}"


@dataclass
class ModelOutcome:
    max_diff: float
    keys_match: bool
    loaded_diff: float
    missing: list[str]
    unexpected: list[str]
    tied: bool
    """Whether the wrapped model still computes with one tensor for the tied weights."""
    optim_diff: float
    """Largest difference of the full optimizer state (momentum buffers) from the reference's."""
    optim_reloaded_diff: float
    """The same after ``optim_state_dict_to_load`` into the optimizer and reading it out again."""


def _ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, HF_VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))


def _mesh(strategy: ShardingStrategy, world: int) -> DeviceMesh | None:
    if not strategy.is_hybrid:
        return None
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))


def run_model_case(rank: int, world: int, case: ModelCase) -> ModelOutcome:
    model, block = hf_model(case.kind)
    ref = copy.deepcopy(model)
    wrapped = FSDP(
        model,
        auto_wrap_policy={block},
        sharding_strategy=case.strategy,
        use_orig_params=case.use_orig_params,
        device_mesh=_mesh(case.strategy, world),
    )
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        ids = _ids(step, rank)
        wrapped(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        every = torch.cat([_ids(step, r) for r in range(world)])
        ref(input_ids=every, labels=every).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got, want = wrapped.state_dict(), ref.state_dict()
    max_diff = max(float((got[k] - v).abs().max()) for k, v in want.items())
    optim_diff, reloaded = _optimizer_diffs(wrapped, opt, ref, ref_opt)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.5)
    result = wrapped.load_state_dict(ref.state_dict())
    back = wrapped.state_dict()
    loaded = max(float((back[k] - v).abs().max()) for k, v in ref.state_dict().items())
    tied = case.kind != "gpt2" or _gpt2_tied(wrapped)
    return ModelOutcome(
        max_diff=max_diff,
        keys_match=list(got) == list(want),
        loaded_diff=loaded,
        missing=list(result.missing_keys),
        unexpected=list(result.unexpected_keys),
        tied=tied,
        optim_diff=optim_diff,
        optim_reloaded_diff=reloaded,
    )


def _optimizer_diffs(
    wrapped: FSDP, opt: torch.optim.Optimizer, ref: nn.Module, ref_opt: torch.optim.Optimizer
) -> tuple[float, float]:
    full = FSDP.optim_state_dict(wrapped, opt)
    names = dict(ref.named_parameters())
    assert set(full["state"]) == set(names), sorted(set(full["state"]) ^ set(names))
    diff = max(
        float((full["state"][n]["momentum_buffer"] - ref_opt.state[p]["momentum_buffer"]).abs().max())
        for n, p in names.items()
    )
    assert [len(g["params"]) for g in full["param_groups"]] == [len(names)]
    opt.load_state_dict(FSDP.optim_state_dict_to_load(wrapped, opt, full))
    again = FSDP.optim_state_dict(wrapped, opt)
    reloaded = max(
        float((again["state"][n]["momentum_buffer"] - full["state"][n]["momentum_buffer"]).abs().max()) for n in names
    )
    return diff, reloaded


def _gpt2_tied(wrapped: FSDP) -> bool:
    inner = wrapped.module
    assert isinstance(inner, GPT2LMHeadModel)
    return inner.lm_head.weight is inner.transformer.wte.weight


def run_model_cases(rank: int, world: int, cases: tuple[ModelCase, ...]) -> dict[str, ModelOutcome]:
    return {c.name: run_model_case(rank, world, c) for c in cases}


@dataclass(frozen=True)
class SaveCase:
    kind: str
    strategy: ShardingStrategy
    path: str


def dcp_save(rank: int, world: int, case: SaveCase) -> dict[str, np.ndarray]:
    """Train two Adam steps, save the sharded model and optimizer state dicts with DCP; the
    full values saved (optimizer entries as ``optim/<name>/<key>``)."""
    model, block = hf_model(case.kind)
    wrapped = FSDP(
        model, auto_wrap_policy={block}, sharding_strategy=case.strategy, device_mesh=_mesh(case.strategy, world)
    )
    opt = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    for step in range(2):
        ids = _ids(step, rank)
        wrapped(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
        sharded = {"model": wrapped.state_dict(), "optim": FSDP.optim_state_dict(wrapped, opt)}
        kinds = {type(v).__name__ for v in sharded["model"].values()}
        assert kinds == {"DTensor"}, kinds
        dcp_save_from(sharded, checkpoint_id=case.path)
    return _flat_values(wrapped, opt)


def _flat_values(wrapped: FSDP, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    out = {k: v.numpy().copy() for k, v in wrapped.state_dict().items()}
    for name, values in FSDP.optim_state_dict(wrapped, opt)["state"].items():
        for key, value in values.items():
            out[f"optim/{name}/{key}"] = torch.as_tensor(value).numpy().copy()
    return out


def dcp_load(rank: int, world: int, case: tuple[SaveCase, dict[str, np.ndarray]]) -> float:
    """Load the checkpoint into a differently initialised model on this world; the largest
    difference from the saved full values."""
    save, expected = case
    model, block = hf_model(save.kind)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    wrapped = FSDP(model, auto_wrap_policy={block}, use_orig_params=True)
    opt = torch.optim.Adam(wrapped.parameters(), lr=0.0)
    ids = _ids(7, rank)
    wrapped(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # an optimizer has state to load into only once it has stepped
    opt.zero_grad()
    with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
        template = {"model": wrapped.state_dict(), "optim": FSDP.optim_state_dict(wrapped, opt)}
        dcp_load_into(template, checkpoint_id=save.path)
        wrapped.load_state_dict(template["model"])
        FSDP.optim_state_dict_to_load(wrapped, opt, template["optim"], load_directly=True)
    got = _flat_values(wrapped, opt)
    assert sorted(got) == sorted(expected), sorted(set(got) ^ set(expected))
    return max(float(np.abs(got[k] - v).max()) for k, v in expected.items())
