"""A warning for the optimizer built before wrapping, which would step nothing and say nothing.

Without ``use_orig_params``, wrapping replaces a unit's parameters by its flat parameter: an
optimizer made from ``model.parameters()`` *before* ``FSDP(model)`` holds tensors no forward
uses and no backward gives a gradient, so its ``step()`` changes nothing. ``watch`` records the
replaced parameters (by identity, held weakly); at an optimizer's first ``step()`` a global
step pre-hook looks for them among its parameters and warns once, naming them and the fix.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["StaleOptimizerWarning", "watch"]


class StaleOptimizerWarning(UserWarning):
    """An optimizer steps parameters that FSDP replaced when it wrapped their module."""


_replaced: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
_checked: dict[int, weakref.ref[torch.optim.Optimizer]] = {}
_hook: list[RemovableHandle] = []


def watch(replaced: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Remember ``(name, parameter)`` pairs that wrapping replaced; the first ``step()`` of an
    optimizer that holds any of them warns (``StaleOptimizerWarning``)."""
    for name, p in replaced:
        key = id(p)
        _replaced[key] = (weakref.ref(p, lambda _, key=key: _replaced.pop(key, None)), name)  # type: ignore[misc]  # the default binds this key
    if _replaced and not _hook:
        _hook.append(register_optimizer_step_pre_hook(_first_step))


def _first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    key = id(optimizer)
    seen = _checked.get(key)
    if seen is not None and seen() is optimizer:
        return
    _checked[key] = weakref.ref(optimizer, lambda _: _checked.pop(key, None))
    stale = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _replaced.get(id(p))
            if entry is not None and entry[0]() is p:
                stale.append(entry[1])
    if stale:
        shown = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        warnings.warn(
            f"optimizer: {type(optimizer).__name__} holds {len(stale)} parameter(s) that FullyShardedDataParallel "
            f"replaced by flat parameters when it wrapped their module ({shown}); step() does not change the "
            "model. Build the optimizer after wrapping, from the wrapped model: "
            f"{type(optimizer).__name__}(model.parameters(), ...)",
            StaleOptimizerWarning,
            stacklevel=3,
        )
