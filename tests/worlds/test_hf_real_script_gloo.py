"""A Hugging Face training script as accelerate / llama-recipes write it, end to end (issue 17).

For a tiny GPT-2 and a tiny Llama (built in code, nothing downloaded), on 2 gloo ranks, the same
script runs with torch's FSDP1 and with ours in one world:

- rank 0 builds the model with its weights, rank 1 under ``torch.device("meta")``;
  ``sync_module_states=True`` with a ``param_init_fn`` that gives meta modules storage (FSDP1,
  which refuses ``sync_module_states`` on the CPU, gets the same weights built on every rank);
- ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``;
- llama-recipes' bf16 policy: ``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16,
  buffer_dtype=bf16)``; AdamW; gradient clipping;
- a checkpoint with ``get_state_dict`` + ``dcp.save`` after two steps, a third step, then a fresh
  meta-built model resumed with ``dcp.load`` + ``set_state_dict`` repeats the third step;
- ``generate()`` inside ``FSDP.summon_full_params(model, recurse=False)`` on ``model.module``
  (in fp32: with bf16 units, the root's full fp32 layer norm meets bf16 activations, which the
  CPU's kernels refuse, for FSDP1 as for ours).

Ours equals FSDP1 bit for bit in every loss (bf16 rules out exact parity with the unwrapped
model, so the unwrapped fp32 model is the reference for the losses within bf16's tolerance); the
generated tokens equal FSDP1's and the unwrapped model's; the resumed step's loss equals the
uninterrupted one's exactly.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from fsdp_shell import FSDP
from fsdp_shell.memory.workload import HF_VOCAB, hf_model
from tests.worlds.dist_harness import run_world


def _ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, HF_VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))


def _build(kind: str, rank: int) -> tuple[nn.Module, type[nn.Module]]:
    model, block = hf_model(kind)
    if rank == 0:
        return model, block
    with torch.device("meta"):
        meta, _ = hf_model(kind)
    return meta, block


def _wrap(wrapper: type[nn.Module], kind: str, rank: int, bf16: bool = True) -> nn.Module:
    """Ours as accelerate sets it up (meta model off rank 0, ``sync_module_states``,
    ``param_init_fn``); FSDP1 refuses ``sync_module_states`` on the CPU, so it gets the real
    model on every rank (the same weights, from the same seed)."""
    low = torch.bfloat16
    common: dict[str, object] = {
        "mixed_precision": MixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low) if bf16 else None,
        "device_id": torch.device("cpu"),
        "use_orig_params": True,
    }
    if wrapper is FSDP:
        model, block = _build(kind, rank)
        common |= {
            "sync_module_states": True,
            "param_init_fn": lambda m: m.to_empty(device=torch.device("cpu"), recurse=False),
        }
    else:
        model, block = hf_model(kind)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block})
    return wrapper(model, auto_wrap_policy=policy, **common)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> float:
    ids = _ids(step, rank)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.clip_grad_norm_(1.0)  # type: ignore[operator]  # both wrappers have it
    opt.step()
    opt.zero_grad()
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _generate(model: nn.Module, wrapper: type[nn.Module]) -> list[int]:
    prompt = torch.tensor([[1, 2, 3]])
    with wrapper.summon_full_params(model, recurse=False):  # type: ignore[attr-defined]  # both wrappers have it
        inner = model.module
        assert isinstance(inner, nn.Module)
        out = inner.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)  # type: ignore[operator]  # a Hugging Face model
    tokens: list[int] = out[0].tolist()
    return tokens


def script(rank: int, world: int, args: tuple[str, str]) -> dict[str, object]:
    kind, directory = args
    out: dict[str, object] = {}
    options = StateDictOptions(full_state_dict=False)
    for label, wrapper in (("theirs", TorchFSDP), ("ours", FSDP)):
        model = _wrap(wrapper, kind, rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = [_step(model, opt, step, rank) for step in range(2)]
        if label == "ours":
            msd, osd = get_state_dict(model, opt, options=options)
            dcp_save({"model": msd, "optim": osd}, checkpoint_id=directory)
        losses.append(_step(model, opt, 2, rank))
        out[f"{label} losses"] = losses
        out[f"{label} buffers"] = sorted({str(b.dtype) for b in model.buffers()})
        del model, opt
    fresh = _wrap(FSDP, kind, rank)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    msd, osd = get_state_dict(fresh, fresh_opt, options=options)
    dcp_load({"model": msd, "optim": osd}, checkpoint_id=directory)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    out["resumed"] = _step(fresh, fresh_opt, 2, rank)

    ref, _ = hf_model(kind)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for step in range(3):
        every = torch.cat([_ids(step, r) for r in range(world)])
        loss = ref(input_ids=every, labels=every).loss
        loss.backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss))
    out["reference"] = ref_losses
    for label, wrapper in (("theirs", TorchFSDP), ("ours", FSDP)):
        out[f"{label} tokens"] = _generate(_wrap(wrapper, kind, rank, bf16=False), wrapper)
    plain, _ = hf_model(kind)
    with torch.no_grad():
        out["reference tokens"] = plain.generate(  # type: ignore[operator]  # a Hugging Face model
            torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False, pad_token_id=0
        )[0].tolist()
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_an_accelerate_style_script_runs_as_with_fsdp1(kind: str, tmp_path: Path) -> None:
    for out in run_world(2, script, (kind, str(tmp_path / "checkpoint")), timeout=300):
        assert out["ours losses"] == out["theirs losses"]
        assert out["ours tokens"] == out["theirs tokens"] == out["reference tokens"]
        tokens = out["ours tokens"]
        assert isinstance(tokens, list) and len(tokens) == 8 and tokens[:3] == [1, 2, 3]
        assert out["ours buffers"] == out["theirs buffers"]
        losses = out["ours losses"]
        assert isinstance(losses, list)
        assert out["resumed"] == losses[2]
        assert losses == pytest.approx(out["reference"], rel=3e-2)
