"""A model named on the command line, built on the meta device: ``load_model(SPEC)``.

SPEC is one of:

- a built-in name: ``demo`` (fsdp-demo's ``TinyLM``), ``gpt2-tiny`` and ``llama-tiny`` (the
  test suite's tiny Hugging Face models), ``gpt2`` (GPT-2 small, 124M) or ``llama-7b``
  (``LlamaConfig``'s defaults: Llama 2 7B);
- a Hugging Face ``config.json`` (any ``model_type`` that ``AutoModelForCausalLM`` builds);
- ``package.module:factory``: a callable returning an ``nn.Module``, or a pair of it and a
  step function (``fsdp_shell.predict.StepFn``: makes a batch, runs the model, returns the loss).

Causal language models train on a batch of ``batch_size`` x ``seq`` tokens with their own loss
(``labels=input_ids``); a plain module gets ``torch.randn(*input_shape)`` and the mean of its
output squared. The units are the classes named by ``wrap``, else the model's own
``_no_split_modules`` (Hugging Face's transformer blocks; ``Block`` for the demo); with none,
the whole model is one unit. Nothing is downloaded and no memory is allocated.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_shell.predict.trace import StepFn

__all__ = ["BUILT_IN", "LoadedModel", "load_model"]

BUILT_IN = ("demo", "gpt2-tiny", "llama-tiny", "gpt2", "llama-7b")


@dataclass(frozen=True, slots=True, eq=False)
class LoadedModel:
    """A model on the meta device, how one step runs it, and which classes are its units."""

    name: str
    module: nn.Module
    step: StepFn
    wrap: frozenset[type[nn.Module]]
    """Empty: the whole model is one unit."""
    inputs: str
    """The batch, for people (``8 x 1024 tokens``)."""


def load_model(
    spec: str,
    *,
    batch_size: int = 8,
    seq: int | None = None,
    input_shape: Sequence[int] | None = None,
    wrap: Sequence[str] = (),
) -> LoadedModel:
    """The model SPEC names (module docstring), built on the meta device. ``seq`` defaults to
    the model's longest context, at most 1024. ``ValueError`` naming ``model`` (or the option)
    for what cannot be loaded."""
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    if seq is not None and seq < 1:
        raise ValueError(f"seq: expected >= 1, got {seq}")
    module, step = _build(spec)
    name = spec
    if step is None:
        vocab, context = _language_model(module)
        if vocab:
            length = min(context or 1024, 1024) if seq is None else seq
            step, inputs = _lm_step(module, vocab, batch_size, length), f"{batch_size} x {length} tokens"
        elif input_shape:
            shape = tuple(input_shape)
            step, inputs = _plain_step(shape), "randn(" + ", ".join(map(str, shape)) + ")"
        else:
            raise ValueError(
                f"model: {spec} is no language model (no config.vocab_size); give --input-shape, or make the "
                "factory return (module, step)"
            )
    else:
        inputs = "the factory's step"
    return LoadedModel(name=name, module=module, step=step, wrap=_wrap_classes(module, wrap), inputs=inputs)


def _build(spec: str) -> tuple[nn.Module, StepFn | None]:
    if spec in BUILT_IN:
        return _built_in(spec), None
    if spec.endswith(".json") or Path(spec).is_file():
        return _from_config_file(Path(spec)), None
    if ":" in spec:
        return _from_factory(spec)
    raise ValueError(
        f"model: unknown {spec!r}; accepted: {', '.join(BUILT_IN)}, a Hugging Face config.json, "
        "or package.module:factory"
    )


def _transformers() -> Any:
    try:
        tf = importlib.import_module("transformers")
    except ImportError:
        raise ValueError("model: Hugging Face models need transformers (pip install -e '.[hf]')") from None
    tf.logging.set_verbosity_error()
    return tf


def _built_in(name: str) -> nn.Module:
    with torch.device("meta"):
        if name == "demo":
            from fsdp_shell.demo.model import ModelConfig, TinyLM

            return TinyLM(ModelConfig())
        tf = _transformers()
        config: Any
        if name == "gpt2-tiny":
            config = tf.GPT2Config(
                vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
            )
        elif name == "llama-tiny":
            config = tf.LlamaConfig(
                vocab_size=64,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=32,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
            )
        elif name == "gpt2":
            config = tf.GPT2Config()
        else:
            config = tf.LlamaConfig()
        module: nn.Module = tf.AutoModelForCausalLM.from_config(config)
        return module


def _from_config_file(path: Path) -> nn.Module:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: cannot read {path} as a JSON config: {exc}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"model: {path} has no model_type; expected a Hugging Face config.json")
    tf = _transformers()
    kind = raw.pop("model_type")
    try:
        config = tf.AutoConfig.for_model(kind, **raw)
        with torch.device("meta"):
            module: nn.Module = tf.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"model: {path}: {exc}") from None
    return module


def _from_factory(spec: str) -> tuple[nn.Module, StepFn | None]:
    where, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(where), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"model: cannot import {spec}: {exc}") from None
    wanted = "a callable taking no arguments that returns an nn.Module or a pair (module, step)"
    if not callable(factory):
        raise ValueError(f"model: {spec} is not callable; SPEC must name {wanted}")
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise ValueError(
            f"model: {spec}{inspect.signature(factory)} needs arguments; SPEC must name {wanted}"
        ) from None
    except ValueError:  # no signature to inspect (some builtins): calling it tells
        pass
    with torch.device("meta"):
        try:
            made = factory()
        except Exception as exc:  # noqa: BLE001  (the user's factory: any failure is reported in one line)
            raise ValueError(f"model: {spec}() raised {type(exc).__name__}: {exc}; SPEC must name {wanted}") from None
    if isinstance(made, nn.Module):
        return made, None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module) and callable(made[1]):
        step: StepFn = made[1]
        return made[0], step
    raise ValueError(f"model: {spec} returned {type(made).__name__}; SPEC must name {wanted}")


def _language_model(module: nn.Module) -> tuple[int, int | None]:
    """The vocabulary size and longest context of a language model; (0, None) for others."""
    from fsdp_shell.demo.model import TinyLM

    if isinstance(module, TinyLM):
        return module.embed.num_embeddings, module.pos.num_embeddings
    config = getattr(module, "config", None)
    vocab = getattr(config, "vocab_size", 0)
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    return (vocab if isinstance(vocab, int) else 0), (context if isinstance(context, int) else None)


def _lm_step(module: nn.Module, vocab: int, batch: int, seq: int) -> StepFn:
    from fsdp_shell.demo.model import TinyLM, lm_loss

    if isinstance(module, TinyLM):

        def tiny(model: nn.Module) -> torch.Tensor:
            tokens = torch.randint(0, vocab, (batch, seq + 1))
            return lm_loss(model(tokens[:, :-1]), tokens[:, 1:])

        return tiny

    def causal_lm(model: nn.Module) -> torch.Tensor:
        ids = torch.randint(0, vocab, (batch, seq))
        loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
        return loss

    return causal_lm


def _plain_step(shape: tuple[int, ...]) -> StepFn:
    def plain(model: nn.Module) -> torch.Tensor:
        out: torch.Tensor = model(torch.randn(*shape)).float().square().mean()
        return out

    return plain


def _wrap_classes(module: nn.Module, names: Sequence[str]) -> frozenset[type[nn.Module]]:
    from fsdp_shell.demo.model import Block, TinyLM

    by_name = {type(m).__name__: type(m) for m in module.modules()}
    if names:
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(
                f"wrap: no module of class {', '.join(unknown)} in the model; it has {', '.join(sorted(by_name))}"
            )
        return frozenset(by_name[n] for n in names)
    if isinstance(module, TinyLM):
        return frozenset({Block})
    declared: Callable[[], object] | list[str] | None = getattr(module, "_no_split_modules", None)
    if isinstance(declared, (list, tuple, set)):
        return frozenset(by_name[n] for n in declared if n in by_name)
    return frozenset()
