"""What FSDP does to a unit's forward inputs and outputs, the same in the hooks
(``fsdp_shell.hooks``) and in the prediction's trace (``fsdp_shell.predict.trace``): the input
casts of mixed precision, and the output tensors that get a pre-backward hook."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_core import MixedPrecision

__all__ = ["cast_inputs", "tensors_in"]


def cast_inputs(
    mp: MixedPrecision, args: tuple[Any, ...], kwargs: dict[str, Any], *, has_params: bool, is_root: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """FSDP1's input casts: a unit with parameters casts its floating-point inputs to
    ``param_dtype`` with ``cast_forward_inputs``, the root with ``cast_root_forward_inputs``
    (the default) too."""
    low = mp.param_dtype
    cast = mp.cast_forward_inputs and has_params
    if is_root:
        cast = cast or mp.cast_root_forward_inputs
    if low is None or not cast:
        return args, kwargs
    cast_args: tuple[tuple[Any, ...], dict[str, Any]] = tree_map(lambda x: _cast_floating(x, low), (args, kwargs))
    return cast_args


def _cast_floating(x: object, dtype: torch.dtype) -> object:
    if isinstance(x, torch.Tensor) and torch.is_floating_point(x):
        return x.to(dtype)
    return x


def tensors_in(out: object) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output, as FSDP1's ``_apply_to_tensors`` finds them: pytree
    containers (tuples, lists, dicts, namedtuples, Hugging Face ``ModelOutput``) and dataclasses."""
    seen: set[int] = set()
    stack = [out]
    while stack:
        leaves, _ = tree_flatten(stack.pop())
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                yield leaf
            elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and id(leaf) not in seen:
                seen.add(id(leaf))
                stack.extend(getattr(leaf, f.name) for f in dataclasses.fields(leaf))
