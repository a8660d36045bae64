"""The demo's models by name: its own ``TinyLM`` or a tiny Hugging Face GPT-2 or Llama.

The Hugging Face ones are built from configurations in code with random weights (nothing is
downloaded) and need ``transformers`` (``pip install -e ".[hf]"``); their decoder blocks are
the FSDP units, and GPT-2's output layer is tied to its embedding.
"""

from __future__ import annotations

import importlib
import logging

import torch
from torch import nn

from fsdp_shell.demo.model import Block, ModelConfig, TinyLM

__all__ = ["ARCHS", "build", "logits"]

ARCHS = ("tiny", "gpt2", "llama")
"""``fsdp-demo --model`` choices."""


def build(cfg: ModelConfig) -> tuple[nn.Module, type[nn.Module]]:
    """A freshly initialised model of ``cfg.arch`` (seed it first) and its block class."""
    if cfg.arch == "tiny":
        return TinyLM(cfg), Block
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if cfg.arch == "gpt2":
        gpt2 = importlib.import_module("transformers.models.gpt2.modeling_gpt2")
        config = gpt2.GPT2Config(
            vocab_size=cfg.vocab,
            n_positions=cfg.seq,
            n_embd=cfg.width,
            n_layer=cfg.layers,
            n_head=cfg.heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        model: nn.Module = gpt2.GPT2LMHeadModel(config)
        block: type[nn.Module] = gpt2.GPT2Block
        return model, block
    if cfg.arch == "llama":
        llama = importlib.import_module("transformers.models.llama.modeling_llama")
        config = llama.LlamaConfig(
            vocab_size=cfg.vocab,
            hidden_size=cfg.width,
            intermediate_size=4 * cfg.width,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=max(1, cfg.heads // 2),
            max_position_embeddings=cfg.seq,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        model = llama.LlamaForCausalLM(config)
        block = llama.LlamaDecoderLayer
        return model, block
    raise ValueError(f"arch: expected one of {', '.join(ARCHS)}, got {cfg.arch!r}")


def logits(model: nn.Module, tokens: torch.Tensor, arch: str) -> torch.Tensor:
    """Next-token logits of ``model`` (wrapped or not) for ``tokens``."""
    out = model(tokens) if arch == "tiny" else model(input_ids=tokens).logits
    assert isinstance(out, torch.Tensor)
    return out
