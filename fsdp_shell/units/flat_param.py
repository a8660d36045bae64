"""One FSDP unit's flat parameter: flatten, shard, all-gather, free, views, and carried gradients.

The local shard (``self.local``, padded to the shard size) is the storage the optimizer owns.
``flat_param`` is the ``nn.Parameter`` autograd sees: its ``.data`` is the local shard when
sharded and the all-gathered buffer when unsharded. As in FSDP1, the all-gathered buffer's
storage is freed and re-allocated in place, so the views autograd saved in forward see the
re-gathered values in backward, and the original parameters are views made by one
``torch.split`` of the flat parameter (one ``SplitWithSizesBackward`` in backward, not one
full-size slice gradient per parameter).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp_core import FlatParamLayout, InputRole, PlanRequest, ShardingSpec, ShardView
from fsdp_shell.runtime.collectives import Pending, all_gather_flat, any_rank
from fsdp_shell.runtime.protocol import Runtime
from fsdp_shell.units.carried import CarriedGrads, set_grad
from fsdp_shell.units.gather_limit import GatherLimiter
from fsdp_shell.units.grads import Grads

__all__ = ["FlatParamHandle", "OrigParam", "split_views"]


@dataclass(frozen=True, slots=True)
class OrigParam:
    """Where an original parameter is registered and its name in the unwrapped model."""

    module: nn.Module
    attr: str
    fqn: str
    aliases: tuple[tuple[nn.Module, str], ...] = ()
    """Further ``(module, attribute)`` registrations of the same (tied) parameter in this unit."""

    def slots(self) -> tuple[tuple[nn.Module, str], ...]:
        """Every ``(module, attribute)`` the parameter is registered under."""
        return ((self.module, self.attr), *self.aliases)


def _alloc_storage(t: torch.Tensor) -> None:
    """Regrow ``t``'s storage in place (views of it stay valid), through the dispatcher
    (``Tensor.resize_``), so tools that watch ops see the allocation on the current stream."""
    if t.untyped_storage().size() != t.numel() * t.element_size():
        shape = t.shape
        t.resize_(0).resize_(shape)


class _Gathered(enum.Enum):
    SHARDED = "sharded"
    IN_FLIGHT = "in_flight"
    UNSHARDED = "unsharded"


@dataclass(frozen=True, slots=True)
class _Pieces:
    """How ``torch.split`` cuts the unsharded flat parameter: every piece's size in order
    (alignment gaps included), and which piece holds which original parameter."""

    sizes: tuple[int, ...]
    param_piece: tuple[int, ...]

    @classmethod
    def of(cls, layout: FlatParamLayout) -> _Pieces:
        sizes: list[int] = []
        param_piece: list[int] = []
        end = 0
        for index in range(len(layout.params)):
            start, stop = layout.param_range(index)
            if start > end:
                sizes.append(start - end)
            param_piece.append(len(sizes))
            sizes.append(stop - start)
            end = stop
        return cls(tuple(sizes), tuple(param_piece))


@functools.lru_cache(maxsize=1024)
def _pieces(layout: FlatParamLayout) -> _Pieces:
    return _Pieces.of(layout)


def split_views(flat: torch.Tensor, layout: FlatParamLayout) -> list[torch.Tensor]:
    """Each original parameter's view of the unsharded flat parameter ``flat``, in its shape,
    all from one ``torch.split`` (alignment gaps are pieces of their own, unused): in backward
    one ``SplitWithSizesBackward`` makes the flat gradient."""
    pieces_of = _pieces(layout)
    pieces = torch.split(flat, list(pieces_of.sizes))
    return [pieces[pieces_of.param_piece[i]].view(p.shape) for i, p in enumerate(layout.params)]


class FlatParamHandle:
    """The flat parameter of one FSDP unit and everything done to it outside the post-backward plan."""

    def __init__(
        self,
        params: list[OrigParam],
        tensors: list[nn.Parameter],
        *,
        base_request: PlanRequest,
        runtime: Runtime,
        shard_group: dist.ProcessGroup,
        device: torch.device,
        limiter: GatherLimiter | None = None,
    ) -> None:
        self.params = params
        self.request = base_request
        """The unit's plan request without this step's flags (``FSDP.set_gradient_divide_factor``
        and ``register_comm_hook`` replace it)."""
        if not isinstance(base_request.layout, FlatParamLayout):
            raise TypeError("base_request.layout: a flat parameter's handle needs a FlatParamLayout")
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
        self._runtime = runtime
        self._limiter = limiter

        local = self.shard_of({p.fqn: t.detach() for p, t in zip(params, tensors)}, self.orig_dtype).clone()
        self.local: torch.Tensor = local.cpu() if self.offload else local
        self.flat_param = nn.Parameter(self.local, requires_grad=any(t.requires_grad for t in tensors))
        self._has_frozen = not all(t.requires_grad for t in tensors)
        self._gathers_in_place = self.is_sharded or self.compute_dtype != self.orig_dtype or self.offload
        self._gathered = torch.empty(
            self.padded_numel if self._gathers_in_place else 0, dtype=self.compute_dtype, device=device
        )
        self._gathered.untyped_storage().resize_(0)
        self._state = _Gathered.SHARDED
        self._pending_gather: Pending | None = None

        self.registered: list[tuple[nn.Module, str]] = []
        """Where ``flat_param`` is registered as a module parameter (``register_flat_param``)."""
        self._host_grad: torch.Tensor | None = None
        self.orig_params: tuple[nn.Parameter, ...] = tuple(tensors) if self.use_orig_params else ()
        """With ``use_orig_params``, the original ``Parameter`` objects (sharded views); else
        none are kept, so their unsharded storage is released once flattened."""
        self.carried = CarriedGrads(self.flat_param, self.orig_params, self.shard_numel)
        """Gradient state carried between backwards and the ``.grad`` handshake (``CarriedGrads``),
        whose verbs are the handle's own: not wrapped, so one call each."""
        self.reclaim = self.carried.reclaim
        self.take_carried = self.carried.take
        self.hand_off = self.carried.hand_off
        self.expose = self.carried.expose
        self._shard_views = {v.param_index: v for v in self.sharding.shard_views(self.layout)}
        self._shard_view_list = self.sharding.shard_views(self.layout)
        for index, p in enumerate(params):
            for module, attr in p.slots():
                del module._parameters[attr]
            if self.use_orig_params:
                orig = self.orig_params[index]
                orig.data = self._sharded_view(index)
                orig.grad = None
                for module, attr in p.slots():
                    module._parameters[attr] = orig
            else:
                tensors[index].data = torch.empty(0, dtype=self.orig_dtype, device=device)

    # -- layout ------------------------------------------------------------------------------

    def shard_of(self, values: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This rank's part (a view) of the padded flat tensor laid out from full per-parameter
        ``values`` by name: parameters, or anything shaped like them (optimizer state). Zeros
        for names not given and for padding."""
        full = torch.zeros(self.padded_numel, dtype=dtype, device=self.device)
        for index, p in enumerate(self.params):
            value = values.get(p.fqn)
            if value is not None:
                start, end = self.layout.param_range(index)
                full[start:end].copy_(value.reshape(-1))
        start = self.sharding.rank * self.shard_numel if self.is_sharded else 0
        return full[start : start + self.shard_numel]

    def gather_full(self, local: torch.Tensor) -> torch.Tensor:
        """The padded flat tensor whose shards are every rank's ``local`` (a collective over the
        shard group when sharded; ``local`` itself otherwise)."""
        if not self.is_sharded:
            return local
        out = torch.empty(self.padded_numel, dtype=local.dtype, device=local.device)
        all_gather_flat(out, local, self.shard_group)
        return out

    def shard_view(self, index: int) -> ShardView | None:
        """Where this rank's shard holds part of original parameter ``index`` (None: nowhere)."""
        return self._shard_views.get(index)

    def _sharded_view(self, index: int) -> torch.Tensor:
        """FSDP1's ``_use_sharded_views``: a 1-D slice of the local shard for sharded strategies
        (empty where this rank holds none of the parameter); the original shape for NO_SHARD."""
        view = self._shard_views.get(index)
        if view is None:
            return self.local.new_empty(0)
        piece = self.local[view.offset_in_buffer : view.offset_in_buffer + view.numel]
        return piece if self.is_sharded else piece.view(self.layout.params[index].shape)

    # -- unshard / reshard -------------------------------------------------------------------

    @property
    def unsharded(self) -> bool:
        """Whether ``flat_param`` is the unsharded parameter now."""
        return self._state is _Gathered.UNSHARDED

    def start_unshard(self) -> bool:
        """Issue the all-gather of the flat parameter in the compute dtype, asynchronously where
        the backend allows; a no-op when gathered or in flight. Returns whether one was issued.
        A shard in another dtype or on another device is cast into its own slot of the gathered
        memory, which the all-gather then fills in place: no copy of the shard is held while it
        is in flight."""
        if self._state is not _Gathered.SHARDED:
            return False
        if not self._gathers_in_place:
            self._state = _Gathered.IN_FLIGHT
            self._pending_gather = None
            return False
        if self._limiter is not None:
            self._limiter.before_gather()
        _alloc_storage(self._gathered)
        with torch.no_grad():
            if not self.is_sharded:
                self._gathered.copy_(self.local, non_blocking=True)
            elif self.local.dtype == self.compute_dtype and self.local.device == self.device:
                self._pending_gather = self._runtime.all_gather(self._gathered, self.local)
            else:
                mine = self._gathered.narrow(0, self.sharding.rank * self.shard_numel, self.shard_numel)
                mine.copy_(self.local, non_blocking=True)
                self._pending_gather = self._runtime.all_gather(self._gathered, mine)
        self._state = _Gathered.IN_FLIGHT
        return True

    def finish_gather(self) -> None:
        """Block until an issued all-gather has landed."""
        pending, self._pending_gather = self._pending_gather, None
        if pending is not None:
            pending.wait()

    def finish_unshard(self) -> None:
        """Wait for the all-gather (issuing it first if needed) and make the unsharded flat
        parameter what autograd sees."""
        if self._state is _Gathered.UNSHARDED:
            return
        self.start_unshard()
        self.finish_gather()
        gathered = self._gathered if self._gathers_in_place else self.local
        self.flat_param.data = gathered[: self.layout.total_numel]
        self._state = _Gathered.UNSHARDED

    def free_unsharded(self) -> None:
        """Reshard: point ``flat_param`` back at the local shard and free the gathered storage."""
        if self._state is _Gathered.SHARDED:
            return
        if self._state is _Gathered.IN_FLIGHT:
            self.finish_unshard()
        self.flat_param.data = self.local
        if self._gathers_in_place:
            self._gathered.untyped_storage().resize_(0)
            if self._limiter is not None:
                self._limiter.freed()
        self._state = _Gathered.SHARDED

    def use_unsharded_views(self) -> None:
        """Make each original parameter's attribute a view of the unsharded flat parameter, all
        from one ``torch.split`` (alignment gaps are pieces of their own, unused)."""
        assert self.unsharded
        for p, view in zip(self.params, split_views(self.flat_param, self.layout)):
            for module, attr in p.slots():
                if self.use_orig_params:
                    module._parameters[attr] = view  # type: ignore[assignment]  # a view tensor stands in for the Parameter during forward
                else:
                    setattr(module, attr, view)

    def restore_params(self) -> None:
        """After forward (and after backward, which uses the unsharded views again so that
        activation checkpointing recomputes with them): with ``use_orig_params`` the original
        ``Parameter`` objects come back."""
        for p, orig in zip(self.params, self.orig_params):
            for module, attr in p.slots():
                module._parameters[attr] = orig

    # -- gradients around a backward ---------------------------------------------------------

    def take_grad(self) -> torch.Tensor:
        """The unsharded gradient autograd just accumulated, detached from the parameter."""
        g = self.flat_param.grad
        if g is None:
            raise RuntimeError("post-backward hook fired without a gradient on the flat parameter")
        self.flat_param.grad = None
        return g

    def expose_views(self, value: Grads, views: tuple[ShardView, ...]) -> None:
        """Point the original parameters' ``.grad`` at their slices of ``grad`` (None where this
        rank holds none of a parameter); unsharded views take the parameter's shape."""
        grad = value
        assert isinstance(grad, torch.Tensor), "a flat parameter's plans bind one tensor to each buffer"
        by_index = {v.param_index: v for v in views}
        shaped = not self.is_sharded or views != self._shard_view_list
        for index, orig in enumerate(self.orig_params):
            v = by_index.get(index)
            if v is None or not orig.requires_grad:
                orig.grad = None
                continue
            piece = grad[v.offset_in_buffer : v.offset_in_buffer + v.numel]
            set_grad(orig, piece.view(self.layout.params[index].shape) if shaped else piece)

    def host_grad_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The host buffer an offloaded gradient is copied into: one per unit, kept across
        backwards (FSDP1's ``_cpu_grad``), from the runtime (pinned on a GPU, so the
        device-to-host copy can be non-blocking)."""
        buf = self._host_grad
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._runtime.host_empty(numel, dtype)
            self._host_grad = buf
        return buf

    def optimizer_grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer steps on (for clipping): the flat parameter's, or with
        ``use_orig_params`` every original parameter's (frozen ones have none) — as the one flat
        sharded gradient they are views of when no parameter of the unit is frozen (one norm,
        not one per parameter; the padding between them is zero)."""
        if not self.use_orig_params:
            return [] if self.flat_param.grad is None else [self.flat_param.grad]
        views = [p.grad for p in self.orig_params if p.grad is not None]
        flat = self.carried.tensors.get(InputRole.SHARDED_GRAD)
        if views and flat is not None and not self._has_frozen:
            return [flat]
        return views

    # -- full values --------------------------------------------------------------------------

    def full_flat(self) -> torch.Tensor:
        """The whole flat parameter in its original dtype, on every rank (a collective)."""
        return self.gather_full(self.local.to(device=self.device, dtype=self.orig_dtype))

    def full_grad_flat(self) -> torch.Tensor | None:
        """With ``use_orig_params``: the whole reduced gradient, on every rank, or None where no
        rank of the shard group has one (as FSDP1's ``with_grads``). Collectives over the shard
        group, so every rank decides alike: whether any rank shows a gradient, then the gather. A
        rank showing none (its gradients set to None, or a shard holding only padding, where
        no original parameter has a ``.grad``) contributes zeros. Gathered on the compute device in
        the parameters' dtype (an offloaded gradient is copied there first)."""
        shown = any(p.grad is not None for p in self.orig_params)
        local = self.sharded_grad_flat() if shown else None
        if self.is_sharded and not any_rank(local is not None, self.shard_group, self.device):
            return None
        if local is None:
            if not self.is_sharded:
                return None
            local = torch.zeros(self.shard_numel, dtype=self.orig_dtype, device=self.device)
        return self.gather_full(local.to(device=self.device, dtype=self.orig_dtype))

    def full_values(self) -> dict[str, torch.Tensor]:
        """Each original parameter's full value by its unwrapped name."""
        flat = self.full_flat()
        out = {}
        for index, p in enumerate(self.params):
            start, end = self.layout.param_range(index)
            out[p.fqn] = flat[start:end].view(self.layout.params[index].shape).clone()
        return out

    def frozen_names(self) -> list[str]:
        """The original parameters of this unit that do not require gradients."""
        if self.use_orig_params:
            return [p.fqn for p, orig in zip(self.params, self.orig_params) if not orig.requires_grad]
        return [] if self.flat_param.requires_grad else [p.fqn for p in self.params]

    def register_flat_param(self, module: nn.Module, name: str) -> None:
        """Make ``flat_param`` ``module``'s parameter ``name`` (``summon_full_params`` lifts it
        out again while the original parameters are shown)."""
        module.register_parameter(name, self.flat_param)
        self.registered.append((module, name))

    def full_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each original parameter's view of ``flat`` (a whole flat parameter, as ``full_flat``
        returns it), in its original shape."""
        start_end = (self.layout.param_range(i) for i in range(len(self.params)))
        return [flat[a:b].view(self.layout.params[i].shape) for i, (a, b) in enumerate(start_end)]

    def load_full_flat(self, flat: torch.Tensor) -> None:
        """Set the local shard from ``flat``, a whole padded flat parameter."""
        start = self.sharding.rank * self.shard_numel if self.is_sharded else 0
        with torch.no_grad():
            self.local.copy_(flat[start : start + self.shard_numel])

    def sharded_grad_flat(self) -> torch.Tensor | None:
        """The reduced sharded gradient the optimizer steps on (None before any backward)."""
        if not self.use_orig_params:
            return self.flat_param.grad
        return self.carried.tensors.get(InputRole.SHARDED_GRAD)

    def load_values(self, values: Mapping[str, torch.Tensor]) -> None:
        """Set the local shard from full values of every original parameter."""
        with torch.no_grad():
            self.local.copy_(self.shard_of(values, self.orig_dtype))
