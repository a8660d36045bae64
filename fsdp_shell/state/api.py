"""FSDP1's state-dict and optimizer-state-dict API, as a base class of
``FullyShardedDataParallel`` (``fsdp_shell.fsdp``): ``state_dict`` / ``load_state_dict`` under
``state_dict_type``, ``full_state_dict``, ``optim_state_dict`` and its inverse. Each method
answers from the tree's handles and state entries through ``fsdp_shell.state.state_dict`` and
``fsdp_shell.state.optim_state``; the wrapper class keeps the rest of FSDP1's API."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed.fsdp.api as fsdp_api
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from fsdp_shell.options import flag
from fsdp_shell.state.optim_state import optim_state_dict as optim_state_dict_of
from fsdp_shell.state.optim_state import optim_state_dict_to_load, param_group_names
from fsdp_shell.state.state_dict import (
    StateDictSettings,
    StateDictType,
    full_state_dict,
    load_state_dict,
    sharded_state_dict,
    state_dict_settings,
    torch_settings,
)
from fsdp_shell.tree import Tree

__all__ = ["StateDictAPI", "root_of", "roots"]


class StateDictAPI:
    """The state-dict half of FSDP1's API. Every ``FullyShardedDataParallel`` is one; what it
    needs of the wrapper is its tree and the checks below, which the wrapper defines."""

    _tree: Tree

    @property
    def _is_root(self) -> bool:
        raise NotImplementedError

    def _require_root(self, what: str) -> None:
        raise NotImplementedError

    def _require_state_root(self, what: str) -> None:
        raise NotImplementedError

    def _set(self, **changes: Any) -> None:
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, Any]:
        """Full, unsharded values under the unwrapped module's ``state_dict()`` keys (every name
        of a tied parameter, persistent buffers, ``_extra_state``), on every rank."""
        self._require_root("full_state_dict")
        tree = self._tree
        return full_state_dict(tree.flat_handles, tree.state_entries, StateDictSettings(), tree.groups.shard.rank())

    def load_full_state_dict(self, state_dict: Mapping[str, object], strict: bool = True) -> _IncompatibleKeys:
        """Load what ``full_state_dict()`` (or the unwrapped module's ``state_dict()``) returns;
        ``strict`` and the result as ``nn.Module.load_state_dict``."""
        self._require_root("load_full_state_dict")
        return load_state_dict(
            self._tree.flat_handles, self._tree.state_entries, state_dict, strict=flag("strict", strict)
        )

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """FSDP1's default: the full state dict under the unwrapped module's keys; inside
        ``FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)``, DTensor shards for
        ``torch.distributed.checkpoint``. A collective: every rank calls it. On a nested unit,
        ``RuntimeError`` naming the root's keys to use: the unit's own ``nn.Module`` state dict
        would be its flat parameter's shard."""
        self._require_state_root("state_dict")
        if args:
            raise TypeError("state_dict: pass destination, prefix and keep_vars by keyword")
        tree = self._tree
        settings = tree.settings.state_dict
        if settings.kind is StateDictType.SHARDED_STATE_DICT:
            values = sharded_state_dict(tree.flat_handles, tree.state_entries, settings, tree.mesh)
        else:
            values = full_state_dict(tree.flat_handles, tree.state_entries, settings, tree.groups.shard.rank())
        out: Any = {} if destination is None else destination
        for key, value in values.items():
            out[prefix + key] = value
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """The inverse of ``state_dict()``: full tensors or DTensors under the unwrapped
        module's keys, copied into this rank's shards. ``RuntimeError`` on a nested unit, as
        ``state_dict()``."""
        self._require_state_root("load_state_dict")
        if assign:
            raise ValueError("load_state_dict: assign=True would replace the sharded parameters; use assign=False")
        return load_state_dict(
            self._tree.flat_handles, self._tree.state_entries, state_dict, strict=flag("strict", strict)
        )

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: object,
        state_dict_config: object = None,
        optim_state_dict_config: object = None,
    ) -> Iterator[None]:
        """FSDP1's context manager: ``state_dict()`` / ``load_state_dict()`` of every FSDP root in
        ``module`` use ``state_dict_type`` (ours or torch's ``StateDictType``) inside."""
        previous = StateDictAPI.set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
        try:
            yield
        finally:
            for root in roots(module):
                root._set(state_dict=previous)

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: object,
        state_dict_config: object = None,
        optim_state_dict_config: object = None,
    ) -> StateDictSettings:
        """Set what ``state_dict()`` returns for every FSDP root in ``module``; returns the
        previous settings."""
        settings = state_dict_settings(state_dict_type, state_dict_config)
        if optim_state_dict_config is not None:
            state_dict_settings(state_dict_type, optim_state_dict_config)
        found = roots(module)
        if not found:
            raise ValueError("module: contains no FullyShardedDataParallel root")
        previous = found[0]._tree.settings.state_dict
        for root in found:
            root._set(state_dict=settings)
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> fsdp_api.StateDictSettings:
        """FSDP1's: the state-dict settings of the FSDP roots in ``module``, as torch's
        ``StateDictSettings``; ``ValueError`` when there is no root or the roots differ."""
        found = roots(module)
        if not found:
            raise ValueError("module: contains no FullyShardedDataParallel root")
        kinds = {root._tree.settings.state_dict for root in found}
        if len(kinds) > 1:
            raise ValueError(f"module: its FullyShardedDataParallel roots use different state-dict types: {kinds}")
        return torch_settings(kinds.pop())

    @staticmethod
    def optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: object = None, group: object = None
    ) -> dict[str, Any]:
        """FSDP1's ``FSDP.optim_state_dict``: ``optim``'s state under the original parameter
        names, full or (inside ``state_dict_type(..., SHARDED_STATE_DICT)``) as DTensors that
        ``torch.distributed.checkpoint`` saves. A collective."""
        if optim_state_dict is not None or group is not None:
            raise ValueError("optim_state_dict, group: not supported; the optimizer's own state is read")
        tree = root_of(model)._tree
        return optim_state_dict_of(
            tree.flat_handles, optim, tree.settings.state_dict, tree.mesh, tree.groups.shard.rank(), tree.ignored_params
        )

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: Mapping[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: object = None,
    ) -> dict[str, Any]:
        """FSDP1's inverse: what ``optim.load_state_dict`` takes on this rank (with
        ``load_directly``, loaded and returned). A collective."""
        if is_named_optimizer or group is not None:
            raise ValueError("is_named_optimizer, group: not supported")
        tree = root_of(model)._tree
        out = optim_state_dict_to_load(tree.flat_handles, optim, optim_state_dict, tree.ignored_params)
        if load_directly:
            optim.load_state_dict(out)
        return out

    @staticmethod
    def _frozen_state_keys(model: nn.Module) -> set[str]:
        """The ``state_dict()`` keys of the parameters that do not require gradients (every name
        of a tied one), ignored parameters included."""
        root = root_of(model)
        tree = root._tree
        frozen = {n for h in tree.flat_handles for n in h.frozen_names()}
        frozen |= {n for n, p in tree.ignored_params if not p.requires_grad}
        return {e.key for e in tree.state_entries if e.param in frozen}

    @staticmethod
    def _optim_group_names(model: nn.Module, optim: torch.optim.Optimizer) -> list[list[str]]:
        """The original parameter names of each of ``optim``'s groups (no collective)."""
        tree = root_of(model)._tree
        return param_group_names(tree.flat_handles, optim, tree.ignored_params)


def root_of(model: nn.Module) -> StateDictAPI:
    """The one FSDP root in ``model``; ``ValueError`` when there is none or several."""
    found = roots(model)
    if len(found) != 1:
        raise ValueError(f"model: expected one FullyShardedDataParallel root, found {len(found)}")
    return found[0]


def roots(module: nn.Module) -> list[StateDictAPI]:
    """Every FSDP root in ``module``."""
    return [m for m in module.modules() if isinstance(m, StateDictAPI) and m._is_root]
