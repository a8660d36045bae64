"""One FSDP unit's flat parameter: flatten, shard, all-gather, free, and the original parameters.

The local shard (``self.local``, padded to the shard size) is the storage the optimizer owns.
``flat_param`` is the ``nn.Parameter`` autograd sees: its ``.data`` is the local shard when
sharded and a view of the all-gathered buffer when unsharded. As in FSDP1, the all-gathered
buffer's storage is freed and re-allocated in place, so the views autograd saved in forward see
the re-gathered values in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp_shell.collectives import all_gather_flat
from fsdp_core import (
    Destination,
    FlatParamLayout,
    PlanRequest,
    ShardingSpec,
    ShardView,
)

__all__ = ["FlatParamHandle", "OrigParam"]


@dataclass(frozen=True, slots=True)
class OrigParam:
    """An original parameter: where it is registered and its name in the unwrapped model."""

    module: nn.Module
    attr: str
    fqn: str
    param: nn.Parameter


def _free_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    want = t.numel() * t.element_size()
    if storage.size() != want:
        storage.resize_(want)


def set_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``param.grad = grad``, also when their shape or dtype differ (unsharded views of a
    sharded parameter, low-precision gradients), as FSDP1 does through ``.data``."""
    if grad is None:
        param.grad = None
        return
    if grad.shape == param.shape and grad.dtype == param.dtype and grad.device == param.device:
        param.grad = grad
        return
    param.grad = torch.empty_like(param)
    assert param.grad is not None
    param.grad.data = grad


class FlatParamHandle:
    """The flat parameter of one FSDP unit and everything done to it outside the post-backward plan."""

    def __init__(
        self,
        params: list[OrigParam],
        *,
        base_request: PlanRequest,
        shard_group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        self.params = params
        self.request = base_request
        self.layout: FlatParamLayout = base_request.layout
        self.sharding: ShardingSpec = base_request.sharding
        self.shard_group = shard_group
        self.device = device
        self.use_orig_params = base_request.use_orig_params
        self.offload = base_request.offload.offload_params
        self.orig_dtype = self.layout.dtype
        self.compute_dtype = base_request.mixed_precision.compute_dtype(self.orig_dtype)
        self.shard_numel = self.sharding.shard_numel(self.layout)
        self.padded_numel = self.sharding.padded_numel(self.layout)
        self.is_sharded = self.sharding.strategy.is_sharded

        full = self._flatten([p.param.detach() for p in params])
        start = self.sharding.rank * self.shard_numel if self.is_sharded else 0
        local = full[start : start + self.shard_numel].clone()
        self.local: torch.Tensor = local.cpu() if self.offload else local
        self.flat_param = nn.Parameter(self.local, requires_grad=True)
        self._gathered = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=device)
        _free_storage(self._gathered)
        self.unsharded = False

        self.saved_grad: torch.Tensor | None = None
        """The reduced sharded gradient from earlier backwards, to accumulate into."""
        self.pending_unsharded: torch.Tensor | None = None
        """The unsharded gradient accumulated inside ``no_sync``."""
        self.partial: torch.Tensor | None = None
        """A shard-group reduction whose replicate all-reduce was deferred."""
        self.flat_grad: torch.Tensor | None = None
        """The sharded gradient the optimizer sees (through views with ``use_orig_params``)."""

        self._shard_view_list = self.sharding.shard_views(self.layout)
        self._shard_views = {v.param_index: v for v in self._shard_view_list}
        for index, p in enumerate(params):
            del p.module._parameters[p.attr]
            if self.use_orig_params:
                p.param.data = self._sharded_view(index)
                p.param.grad = None
                p.module._parameters[p.attr] = p.param

    # -- layout ------------------------------------------------------------------------------

    def _flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        full = torch.zeros(self.padded_numel, dtype=self.orig_dtype, device=self.device)
        for (start, end), t in zip((self.layout.param_range(i) for i in range(len(tensors))), tensors):
            full[start:end].copy_(t.reshape(-1))
        return full

    def _sharded_view(self, index: int) -> torch.Tensor:
        """FSDP1's ``_use_sharded_views``: a 1-D slice of the local shard for sharded strategies
        (empty where this rank holds none of the parameter); the original shape for NO_SHARD."""
        view = self._shard_views.get(index)
        if view is None:
            return self.local.new_empty(0)
        piece = self.local[view.offset_in_buffer : view.offset_in_buffer + view.numel]
        return piece if self.is_sharded else piece.view(self.layout.params[index].shape)

    # -- unshard / reshard -------------------------------------------------------------------

    def unshard(self) -> None:
        """All-gather the flat parameter (in the compute dtype) and make it what autograd sees."""
        if self.unsharded:
            return
        _alloc_storage(self._gathered)
        with torch.no_grad():
            src = self.local.to(device=self.device, dtype=self.compute_dtype)
            if self.is_sharded:
                all_gather_flat(self._gathered, src, self.shard_group)
            else:
                self._gathered.copy_(src)
        self.flat_param.data = self._gathered[: self.layout.total_numel]
        self.unsharded = True

    def free_unsharded(self) -> None:
        """Reshard: point ``flat_param`` back at the local shard and free the gathered storage."""
        if not self.unsharded:
            return
        self.flat_param.data = self.local
        _free_storage(self._gathered)
        self.unsharded = False

    def use_unsharded_views(self) -> None:
        """Make each original parameter's attribute an autograd view of the unsharded flat parameter."""
        assert self.unsharded
        for index, p in enumerate(self.params):
            start, end = self.layout.param_range(index)
            view = self.flat_param[start:end].view(self.layout.params[index].shape)
            if self.use_orig_params:
                p.module._parameters[p.attr] = view  # type: ignore[assignment]  # a view tensor stands in for the Parameter during forward
            else:
                setattr(p.module, p.attr, view)

    def restore_params(self) -> None:
        """After forward: with ``use_orig_params`` the original ``Parameter`` objects come back."""
        if not self.use_orig_params:
            return
        for p in self.params:
            p.module._parameters[p.attr] = p.param

    # -- gradients around a backward ---------------------------------------------------------

    def prepare_for_backward(self) -> None:
        """Take the gradient the optimizer saw out of the way of autograd, keeping it to
        accumulate into unless the user has zeroed it (``set_to_none``)."""
        if self.use_orig_params:
            if all(p.param.grad is None for p in self.params):
                self.flat_grad = None
                self.saved_grad = None
                self.pending_unsharded = None
            else:
                self.saved_grad = self.flat_grad
        else:
            g = self.flat_param.grad
            self.saved_grad = g if g is not None and g.numel() == self.shard_numel else None
            if g is not None and g.numel() == self.layout.total_numel and self.is_sharded:
                self.pending_unsharded = g
        self.flat_param.grad = None

    def take_grad(self) -> torch.Tensor:
        """The unsharded gradient autograd just accumulated, detached from the parameter."""
        g = self.flat_param.grad
        if g is None:
            raise RuntimeError("post-backward hook fired without a gradient on the flat parameter")
        self.flat_param.grad = None
        return g

    def receive(self, grad: torch.Tensor, destination: Destination) -> None:
        """Take what the plan hands off."""
        match destination:
            case Destination.UNSHARDED_GRAD:
                self.pending_unsharded = grad
            case Destination.PARTIAL:
                self.partial = grad
                self.pending_unsharded = None
            case Destination.SHARDED_GRAD | Destination.ACCUMULATED_GRAD | Destination.CPU_GRAD:
                self.flat_grad = grad
                self.saved_grad = None
                self.pending_unsharded = None
                self.partial = None
                if not self.use_orig_params:
                    set_grad(self.flat_param, grad)

    def set_grad_views(self, grad: torch.Tensor, views: tuple[ShardView, ...]) -> None:
        """Point the original parameters' ``.grad`` at their slices of ``grad`` (None where this
        rank holds none of a parameter); unsharded views take the parameter's shape."""
        by_index = {v.param_index: v for v in views}
        unsharded = self.is_sharded and views != self._shard_view_list
        for index, p in enumerate(self.params):
            v = by_index.get(index)
            if v is None:
                p.param.grad = None
                continue
            piece = grad[v.offset_in_buffer : v.offset_in_buffer + v.numel]
            shaped = unsharded or not self.is_sharded
            set_grad(p.param, piece.view(self.layout.params[index].shape) if shaped else piece)

    def restore_saved_grad(self) -> None:
        """A backward in which this unit's post-backward never ran leaves its gradient as it was."""
        if not self.use_orig_params and self.saved_grad is not None and self.flat_param.grad is None:
            set_grad(self.flat_param, self.saved_grad)
        self.saved_grad = None

    # -- full values --------------------------------------------------------------------------

    def full_flat(self) -> torch.Tensor:
        """The whole flat parameter in its original dtype, on every rank (a collective)."""
        src = self.local.to(device=self.device, dtype=self.orig_dtype)
        if not self.is_sharded:
            return src
        out = torch.empty(self.padded_numel, dtype=self.orig_dtype, device=self.device)
        all_gather_flat(out, src, self.shard_group)
        return out

    def full_values(self) -> dict[str, torch.Tensor]:
        """Each original parameter's full value by its unwrapped name."""
        flat = self.full_flat()
        out = {}
        for index, p in enumerate(self.params):
            start, end = self.layout.param_range(index)
            out[p.fqn] = flat[start:end].view(self.layout.params[index].shape).clone()
        return out

    def load_values(self, values: dict[str, torch.Tensor]) -> None:
        """Set the local shard from full values of every original parameter."""
        full = self._flatten([values[p.fqn].to(self.orig_dtype) for p in self.params])
        start = self.sharding.rank * self.shard_numel if self.is_sharded else 0
        with torch.no_grad():
            self.local.copy_(full[start : start + self.shard_numel].to(self.local.device))
