"""``torch.distributed.checkpoint.state_dict`` for models that hold FSDP roots of ours.

Torch's ``get_state_dict`` / ``set_state_dict`` (and their model and optimizer halves) recognise
FSDP1 by its class and then reach into its flat-parameter internals; any other model they map
through ``named_parameters()``, expecting full tensors or ``DTensor`` s as parameters. A wrapper
of ours is neither, so ``install`` (called when the first wrapper is made) puts a dispatch in
front of the four private helpers those public functions call at call time
(``_get_model_state_dict``, ``_get_optim_state_dict``, ``_load_model_state_dict``,
``_load_optim_state_dict``). For a model that holds a root of ours the helper runs the wrapper's
own state-dict API under the state-dict type the options ask for: ``full_state_dict=True`` is
``FULL_STATE_DICT`` (``cpu_offload``: on the host, rank 0 only, as torch's FSDP1 path), else
``SHARDED_STATE_DICT`` (DTensors that ``torch.distributed.checkpoint`` saves and loads at any
world size); ``strict``, ``ignore_frozen_params`` and ``broadcast_from_rank0`` are honoured. Any
other model gets torch's helper unchanged. Options this path cannot honour
(``flatten_optimizer_state_dict``, ``submodules``) raise ``ValueError`` naming them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as torch_dsd
import torch.distributed.fsdp.api as fsdp_api
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from fsdp_shell.runtime.collectives import broadcast_flat

__all__ = ["Wrapper", "install"]


class Wrapper(Protocol):
    """What this module needs of the wrapper class (``FullyShardedDataParallel``'s static API)."""

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> Sequence[nn.Module]: ...

    @staticmethod
    def state_dict_type(
        module: nn.Module,
        state_dict_type: object,
        state_dict_config: object = None,
        optim_state_dict_config: object = None,
    ) -> contextlib.AbstractContextManager[None]: ...

    @staticmethod
    def optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: object = None, group: object = None
    ) -> dict[str, Any]: ...

    @staticmethod
    def _frozen_state_keys(model: nn.Module) -> set[str]: ...

    @staticmethod
    def _optim_group_names(model: nn.Module, optim: torch.optim.Optimizer) -> list[list[str]]: ...

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: Mapping[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: object = None,
    ) -> dict[str, Any]: ...


_HELPERS = ("_get_model_state_dict", "_get_optim_state_dict", "_load_model_state_dict", "_load_optim_state_dict")
_installed: list[Wrapper] = []


def install(wrapper: type[Wrapper] | Wrapper) -> None:
    """Route torch's state-dict helpers to ``wrapper``'s API for models holding its roots (once)."""
    if _installed:
        return
    _installed.append(wrapper)
    mine: dict[str, Callable[..., Any]] = {
        "_get_model_state_dict": _get_model,
        "_get_optim_state_dict": _get_optim,
        "_load_model_state_dict": _load_model,
        "_load_optim_state_dict": _load_optim,
    }
    for name in _HELPERS:
        setattr(torch_dsd, name, _dispatch(getattr(torch_dsd, name), mine[name]))


def _dispatch(theirs: Callable[..., Any], ours: Callable[..., Any]) -> Callable[..., Any]:
    def helper(model: nn.Module, *args: Any) -> Any:
        wrapper = _installed[0]
        if wrapper.fsdp_modules(model, root_only=True):
            return ours(wrapper, model, *args)
        return theirs(model, *args)

    helper.__wrapped__ = theirs  # type: ignore[attr-defined]  # functools.wraps' attribute, for introspection
    return helper


def _check(info: Any) -> None:
    if info.flatten_optimizer_state_dict:
        raise ValueError(
            "options.flatten_optimizer_state_dict: not offered for FullyShardedDataParallel models; leave it False"
        )
    if info.submodule_prefixes:
        raise ValueError("submodules: not offered for FullyShardedDataParallel models; filter the state dict instead")


@contextlib.contextmanager
def _state_dict_type(wrapper: Wrapper, model: nn.Module, info: Any) -> Iterator[None]:
    if info.full_state_dict:
        kind = fsdp_api.StateDictType.FULL_STATE_DICT
        config: object = fsdp_api.FullStateDictConfig(offload_to_cpu=info.cpu_offload, rank0_only=info.cpu_offload)
        optim: object = fsdp_api.FullOptimStateDictConfig(offload_to_cpu=info.cpu_offload, rank0_only=info.cpu_offload)
    else:
        kind = fsdp_api.StateDictType.SHARDED_STATE_DICT
        config = fsdp_api.ShardedStateDictConfig(offload_to_cpu=info.cpu_offload)
        optim = fsdp_api.ShardedOptimStateDictConfig(offload_to_cpu=info.cpu_offload)
    with wrapper.state_dict_type(model, kind, config, optim):
        yield


def _root(wrapper: Wrapper, model: nn.Module) -> tuple[nn.Module, str]:
    """The one root of ours in ``model`` and its key prefix there."""
    roots = list(wrapper.fsdp_modules(model, root_only=True))
    if len(roots) != 1:
        raise ValueError(f"model: holds {len(roots)} FullyShardedDataParallel roots; expected one")
    (root,) = roots
    name = next(n for n, m in model.named_modules() if m is root)
    return root, f"{name}." if name else ""


def _get_model(wrapper: Wrapper, model: nn.Module, info: Any) -> dict[str, Any]:
    _check(info)
    if not info.handle_model:
        return {}
    with _state_dict_type(wrapper, model, info):
        state: dict[str, Any] = model.state_dict()
    if info.ignore_frozen_params:
        root, prefix = _root(wrapper, model)
        for key in wrapper._frozen_state_keys(root):
            state.pop(prefix + key, None)
    return state


def _get_optim(wrapper: Wrapper, model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], info: Any) -> Any:
    _check(info)
    if not info.handle_optim:
        return {}
    root, prefix = _root(wrapper, model)
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for optim in optimizers:
        torch_dsd._init_optim_state(optim)
        with _state_dict_type(wrapper, model, info):
            osd = wrapper.optim_state_dict(root, optim)
        if not osd:
            continue
        merged["state"].update({prefix + k: v for k, v in osd["state"].items()})
        merged["param_groups"].extend({**g, "params": [prefix + n for n in g["params"]]} for g in osd["param_groups"])
    if not merged["state"] and not merged["param_groups"]:
        return {}
    return merged


def _load_model(wrapper: Wrapper, model: nn.Module, state_dict: dict[str, Any], info: Any) -> Any:
    _check(info)
    if not info.handle_model:
        return nn.modules.module._IncompatibleKeys([], [])
    if info.broadcast_from_rank0:
        state_dict = _broadcast(state_dict)
    with _state_dict_type(wrapper, model, info):
        return model.load_state_dict(state_dict, strict=info.strict)


def _load_optim(
    wrapper: Wrapper,
    model: nn.Module,
    optimizers: tuple[torch.optim.Optimizer, ...],
    state_dict: dict[str, Any],
    info: Any,
) -> None:
    _check(info)
    if not info.handle_optim:
        return
    if info.broadcast_from_rank0:
        state_dict = _broadcast(state_dict)
    root, prefix = _root(wrapper, model)
    saved = {k.removeprefix(prefix): v for k, v in state_dict.get("state", {}).items()}
    groups = [{**g, "params": [n.removeprefix(prefix) for n in g["params"]]} for g in state_dict["param_groups"]]
    for optim in optimizers:
        torch_dsd._init_optim_state(optim)
        mine = _groups_of(wrapper, root, optim, groups)
        with _state_dict_type(wrapper, model, info):
            loaded = wrapper.optim_state_dict_to_load(root, optim, {"state": saved, "param_groups": mine})
        optim.load_state_dict(loaded)


def _groups_of(
    wrapper: Wrapper, root: nn.Module, optim: torch.optim.Optimizer, groups: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The saved parameter groups of ``optim``, matched by parameter names (several optimizers
    over one model each load their own)."""
    by_names = {frozenset(g["params"]): g for g in groups}
    out = []
    for want in wrapper._optim_group_names(root, optim):
        found = by_names.get(frozenset(want))
        if found is None:
            raise ValueError(
                f"optim_state_dict: no saved parameter group holds exactly the parameters {', '.join(want[:3])}"
                f"{', ...' if len(want) > 3 else ''}; the optimizer's groups differ from the checkpoint's"
            )
        out.append(found)
    return out


def _broadcast(tree: object) -> Any:
    """Rank 0's ``tree`` (nested dicts and lists of tensors and plain values) on every rank: its
    structure and plain values as one object, then each tensor by ``dist.broadcast``."""
    rank = dist.get_rank()
    leaves, spec = tree_flatten(tree)
    meta: list[object] = [
        [("tensor", tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", x) for x in leaves],
        spec,
    ]
    dist.broadcast_object_list(meta, src=0)
    described, sent = meta
    assert isinstance(described, list) and isinstance(sent, TreeSpec)
    device = dist.distributed_c10d._get_pg_default_device()
    out = []
    for index, entry in enumerate(described):
        if entry[0] == "value":
            out.append(entry[1])
            continue
        _, shape, dtype = entry
        t = leaves[index].to(device) if rank == 0 else torch.empty(shape, dtype=dtype, device=device)
        broadcast_flat(t, 0)
        out.append(t)
    return tree_unflatten(out, sent)
