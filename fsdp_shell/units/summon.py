"""FSDP1's ``summon_full_params``: the original parameters show their full values inside a block.

On entry every unit of the block (one unit, or with ``recurse`` every unit in the module) gathers
its whole flat parameter in the parameters' own dtype (a collective over the shard group) and
each original parameter's attribute becomes a view of it, in its own shape: the original
``Parameter`` object with ``use_orig_params`` (its ``.data`` swapped), otherwise a new
``Parameter`` viewing it, registered in place of the flat parameter, as in FSDP1 (so
``named_parameters()`` lists the original parameters inside). With ``with_grads``
(``use_orig_params`` only) the gradients are gathered the same way. On exit, with
``writeback``, each rank's shard is taken back from the full values (edits made inside
persist); then everything is put back as it was. ``rank0_only``: only rank 0 sees full values
(the others gather, then keep their shards); ``offload_to_cpu``: the full values live on the
host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from fsdp_shell.units.flat_param import FlatParamHandle

if TYPE_CHECKING:
    from fsdp_shell.tree import Tree

__all__ = ["check_summon_options", "summoned", "summoned_trees"]

_MISSING = object()


def check_summon_options(*, writeback: bool, rank0_only: bool, with_grads: bool, use_orig_params: bool) -> None:
    """FSDP1's refusals, ``ValueError`` naming the arguments."""
    if writeback and rank0_only:
        raise ValueError(
            "writeback, rank0_only: writeback=True with rank0_only=True is not supported: the other ranks "
            "do not see the full parameters, so edits could not be written back consistently"
        )
    if with_grads and not use_orig_params:
        raise ValueError("with_grads: needs use_orig_params=True (the gradients of the original parameters)")


@contextlib.contextmanager
def summoned(
    handles: Sequence[FlatParamHandle],
    *,
    rank: int,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    """Inside: the full parameters of ``handles`` (module docstring). Every rank of the shard
    group must enter with the same handles (the gathers are collectives)."""
    shown = rank == 0 or not rank0_only
    restores: list[Restore] = []
    try:
        for h in handles:
            flat = h.full_flat()
            grads = h.full_grad_flat() if with_grads else None
            if not shown:
                continue
            if offload_to_cpu:
                flat = flat.cpu()
                grads = None if grads is None else grads.cpu()
            restores.append(Restore.show(h, flat, grads))
        yield
    finally:
        for restore in reversed(restores):
            restore.undo(writeback=writeback)


class Restore:
    """What one unit's attributes were before its full values were shown, and how to undo it."""

    def __init__(self, h: FlatParamHandle, flat: torch.Tensor) -> None:
        self.handle = h
        self.flat = flat
        self.attrs: list[tuple[nn.Module, str, object]] = []
        self.params: list[tuple[nn.Module, str, object]] = []
        self.datas: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.grads: list[tuple[nn.Parameter, torch.Tensor | None]] = []

    @classmethod
    def show(cls, h: FlatParamHandle, flat: torch.Tensor, grads: torch.Tensor | None) -> Restore:
        restore = cls(h, flat)
        views = h.full_views(flat)
        grad_views = None if grads is None else h.full_views(grads)
        for index, p in enumerate(h.params):
            if h.use_orig_params:
                orig = h.orig_params[index]
                restore.datas.append((orig, orig.data))
                orig.data = views[index]
                if grad_views is not None:
                    restore.grads.append((orig, orig.grad))
                    orig.grad = grad_views[index] if orig.requires_grad else None
                continue
            shown = nn.Parameter(views[index], requires_grad=h.flat_param.requires_grad)
            for module, attr in p.slots():
                restore.attrs.append((module, attr, module.__dict__.get(attr, _MISSING)))
                restore.params.append((module, attr, module._parameters.get(attr, _MISSING)))
                module.__dict__.pop(attr, None)
                module._parameters[attr] = shown
        if not h.use_orig_params:
            for module, name in h.registered:
                restore.params.append((module, name, module._parameters.pop(name)))
        return restore

    def undo(self, *, writeback: bool) -> None:
        if writeback:
            self.handle.load_full_flat(self.flat.to(self.handle.local.device))
        for orig, data in self.datas:
            orig.data = data
        for orig, grad in self.grads:
            orig.grad = grad
        for module, attr, before in reversed(self.params):
            if before is _MISSING:
                module._parameters.pop(attr, None)
            else:
                module._parameters[attr] = before  # type: ignore[assignment]  # what was there: a Parameter or None
        for module, attr, before in self.attrs:
            if before is _MISSING:
                module.__dict__.pop(attr, None)
            else:
                module.__dict__[attr] = before


@contextlib.contextmanager
def summoned_trees(
    units: Sequence[tuple[Tree, FlatParamHandle | None]],
    *,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    """``summoned`` for the handles of ``units`` (each with its tree), tree by tree; each tree
    counts its open blocks (``Tree.summoning``) while inside. ``RuntimeError`` when a tree is in
    the middle of a backward."""
    by_tree: dict[int, tuple[Tree, list[FlatParamHandle]]] = {}
    for tree, handle in units:
        if tree.iteration.unfinished:
            raise RuntimeError("summon_full_params: not inside forward or backward (a backward is under way)")
        entry = by_tree.setdefault(id(tree), (tree, []))
        if handle is not None:
            entry[1].append(handle)
    with contextlib.ExitStack() as stack:
        for tree, handles in by_tree.values():
            check_summon_options(
                writeback=writeback,
                rank0_only=rank0_only,
                with_grads=with_grads,
                use_orig_params=tree.options.use_orig_params,
            )
            stack.enter_context(
                summoned(
                    handles,
                    rank=tree.groups.shard.rank(),
                    writeback=writeback,
                    rank0_only=rank0_only,
                    offload_to_cpu=offload_to_cpu,
                    with_grads=with_grads,
                )
            )
            tree.summoning += 1
            stack.callback(_closed, tree)
        yield


def _closed(tree: Tree) -> None:
    tree.summoning -= 1
