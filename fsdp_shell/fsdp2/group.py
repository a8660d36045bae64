"""One ``fully_shard`` call's parameters (a per-parameter unit): sharded as PyTorch's FSDP2 shards
them, gathered and freed, and the ``PlanOwner`` the interpreter hands their gradients to.

Each parameter becomes a ``DTensor`` ``nn.Parameter`` (``Shard(dim)`` on a 1-D mesh,
``(Replicate(), Shard(dim))`` on a 2-D one) whose local tensor is a view of the rank's padded
shard, so the optimizer updates the memory the all-gather copies in. Each parameter also has one
persistent unsharded ``nn.Parameter`` whose memory is allocated when the unit is gathered and
freed when it reshards (so autograd's saved references to it see the data again when it is
gathered for backward), and which the module holds while it runs.

Where the numbers come from: the layouts are ``fsdp_core.PerParamLayout``s (one of every
parameter for the all-gather, one of those that take gradients for the reduce-scatter), the
tensors move as ``fsdp_shell.units.per_param`` moves them, and the post-backward is the plan
the planner builds for the reduce layout, run by the interpreter.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp_core import InputRole, PerParamLayout, Plan, ShardedParam, ShardView, UnitDtypes
from fsdp_shell.fsdp2.units import Slot
from fsdp_shell.runtime.collectives import Pending, release
from fsdp_shell.runtime.protocol import Runtime
from fsdp_shell.units.grads import Grads
from fsdp_shell.units.per_param import copy_in, copy_out_into, padded_shard

__all__ = ["ParamGroup", "Slot"]


class ParamGroup:
    """The parameters of one ``fully_shard`` call, sharded over ``mesh``'s last dimension."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        slots: Sequence[Sequence[Slot]],
        layout: PerParamLayout,
        dtypes: UnitDtypes,
        mesh: DeviceMesh,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.dtypes = dtypes
        self.mesh = mesh
        self.rank = mesh.get_local_rank(mesh.ndim - 1)
        self.device = device
        self._slots = [tuple(s) for s in slots]
        self.grad_index = tuple(i for i, p in enumerate(params) if p.requires_grad)
        """The parameters that take gradients, in layout order: the reduce layout's."""
        self.reduce_layout: PerParamLayout | None = (
            PerParamLayout(
                params=tuple(layout.params[i] for i in self.grad_index), dtype=layout.dtype, world=layout.world
            )
            if self.grad_index
            else None
        )
        self._tp: list[tuple[DeviceMesh, tuple[Placement, ...]] | None] = [
            (p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else None for p in params
        ]
        """Per parameter already a ``DTensor`` (tensor parallelism): its mesh and placements, the
        unsharded parameter's; the layout shards its local tensor."""
        self._meta = [_dtensor_meta(spec, mesh, p) for spec, p in zip(layout.params, params)]
        """Per parameter: the mesh, placements, global shape and stride of its sharded ``DTensor``
        and ``.grad``."""
        self._specs: dict[tuple[int, torch.dtype], DTensorSpec] = {}
        """The ``DTensorSpec`` of those, by parameter and dtype (``_dtensor``)."""
        self._views: list[tuple[int, int, torch.Size]] = []
        """Per parameter that takes gradients: offset, numel and shape of this rank's shard in
        the reduced gradient (its ``.grad``'s local tensor), worked out once."""
        if self.reduce_layout is not None:
            r = self.reduce_layout
            for j, spec in enumerate(r.params):
                numel = r.rows(j, self.rank) * spec.row_numel
                self._views.append((r.shard_offsets[j], numel, torch.Size(r.sharded_shape(j, self.rank))))
        on_meta = any(p.is_meta for p in params)
        self._padded: list[torch.Tensor] = []
        self.sharded: list[nn.Parameter] = []
        for i, p in enumerate(params):
            if on_meta:  # shapes only, until ``to_empty`` and ``materialize``
                padded = torch.empty(layout.padded_sharded_shape(i), dtype=p.dtype, device="meta")
            else:
                with torch.no_grad():
                    padded = padded_shard(layout, i, _local(p.detach()).to(device), self.rank)
            self._padded.append(padded)
            local = padded.narrow(layout.params[i].shard_dim, 0, layout.rows(i, self.rank))
            self.sharded.append(nn.Parameter(self._dtensor(i, local), requires_grad=p.requires_grad))
        self._on_grad: Callable[[torch.Tensor], None] | None = None
        self.unsharded: list[nn.Parameter] = []
        self._wholes: list[torch.Tensor] = []
        """The unsharded parameters' (local) tensors."""
        self._stacked: list[torch.Tensor] = []
        self._own_storages: list[torch.UntypedStorage] = []
        """What the unsharded parameters' memory is: freed and refilled."""
        self._own_nbytes: list[int] = []
        self._build_unsharded(torch.device("meta") if on_meta else device)
        self.gathered = False
        """Whether the unsharded parameters hold the gathered values."""
        self._in_flight: tuple[torch.Tensor, Pending | None, int] | None = None
        """A prefetched all-gather: its output buffer, the collective and the number of ranks it
        gathers from, until ``unshard``."""
        self._post_forward: tuple[torch.Tensor, Runtime, int, int] | None = None
        """Between forward and backward, resharded to a smaller group (``reshard_after_forward``
        an int, ZeRO++'s hpZ): this rank's part of every parameter's stacked chunks, the group's
        runtime, its size and this rank's place in it (``reshard_post_forward``)."""
        self.carried: dict[InputRole, Grads] = {}
        """Gradient state carried between backwards, by the role the next plan takes it in: a
        ``no_sync`` accumulation and a partial reduction (the reduced gradient is the ``.grad``
        views', ``reclaim``)."""
        self._shown_base: weakref.ref[torch.Tensor] | None = None
        """The reduced gradient last shown as the sharded parameters' ``.grad``, held weakly."""
        self._shown_ptrs: tuple[int | None, ...] = ()
        """Where those ``.grad`` local tensors start."""
        self.use_sharded()

    # -- DTensors ---------------------------------------------------------------------------

    def _build_unsharded(self, device: torch.device) -> None:
        """Each parameter's unsharded ``nn.Parameter`` (for dimension 0 a view of its stacked
        chunks, the all-gather's copy-out), memory freed; on the meta device only shapes."""
        layout, compute = self.layout, self.dtypes.compute
        self._stacked = [
            torch.empty(layout.gathered_shape(i), dtype=compute, device=device) for i in range(len(layout.params))
        ]
        self.unsharded, self._wholes = [], []
        for i, (spec, stacked, sharded) in enumerate(zip(layout.params, self._stacked, self.sharded)):
            if spec.shard_dim == 0:
                whole = stacked.narrow(0, 0, spec.rows)
            else:
                whole = torch.empty(spec.shape, dtype=compute, device=device)
            self._wholes.append(whole)
            self.unsharded.append(nn.Parameter(self._unsharded_value(i, whole), requires_grad=sharded.requires_grad))
        others = [w for w, spec in zip(self._wholes, layout.params) if spec.shard_dim != 0]
        owned = (*self._stacked, *others)
        self._own_storages = [t.untyped_storage() for t in owned]
        self._own_nbytes = [t.numel() * t.element_size() for t in owned]
        if device.type != "meta":
            for storage in self._own_storages:
                storage.resize_(0)
        if self._on_grad is not None:
            self.hook_grads(self._on_grad)

    def hook_grads(self, on_grad: Callable[[torch.Tensor], None]) -> None:
        """Call ``on_grad(param)`` once autograd has accumulated an unsharded parameter's gradient
        (every parameter that takes gradients; again after ``materialize`` rebuilds them)."""
        self._on_grad = on_grad
        for i in self.grad_index:
            self.unsharded[i].register_post_accumulate_grad_hook(on_grad)  # type: ignore[no-untyped-call]  # unannotated in torch

    def materialize(self) -> None:
        """Before the first forward: where ``nn.Module.to_empty``/``to`` (or a load with
        ``assign=True``) gave a sharded parameter a new local tensor, pad it again and make the
        parameter's local tensor a view of the padded shard, as FSDP2's ``reset_sharded_param``
        does; unsharded parameters still on the meta device are built on the new one. Parameters
        still on the meta device are an error naming the fix."""
        layout, moved = self.layout, None
        for i, p in enumerate(self.sharded):
            assert isinstance(p, DTensor)
            local = p.to_local()
            if local.is_meta:
                raise RuntimeError(
                    f"module: parameter {layout.params[i].name!r} is still on the meta device at the first forward; "
                    "call module.to_empty(device=...) and initialize the parameters first"
                )
            padded = self._padded[i]
            if not padded.is_meta and local.numel() and local.data_ptr() == padded.data_ptr():
                continue
            spec = layout.params[i]
            rows = layout.rows(i, self.rank)
            padded = local.new_zeros(layout.padded_sharded_shape(i))
            with torch.no_grad():
                padded.narrow(spec.shard_dim, 0, rows).copy_(local)
            self._padded[i] = padded
            p._local_tensor = padded.narrow(spec.shard_dim, 0, rows)
            moved = local.device
        if moved is not None and self._stacked and self._stacked[0].device != moved:
            self.device = moved
            self._build_unsharded(moved)

    def _dtensor(self, index: int, local: torch.Tensor) -> DTensor:
        """Parameter ``index``'s sharded ``DTensor`` (or ``.grad``) over ``local``, without
        autograd, from a spec made once per parameter and dtype (FSDP2's
        ``_from_local_no_grad``: ``DTensor.from_local`` costs about 60 us of Python a call)."""
        key = (index, local.dtype)
        spec = self._specs.get(key)
        if spec is None:
            mesh, placements, shape, stride = self._meta[index]
            meta = TensorMeta(shape, stride, local.dtype)
            spec = self._specs[key] = DTensorSpec(mesh, placements, tensor_meta=meta)
        return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]  # unannotated in torch (FSDP2 calls it so)

    def _unsharded_value(self, index: int, whole: torch.Tensor) -> torch.Tensor:
        """What the unsharded parameter ``index`` is: its whole (local) tensor, a ``DTensor`` over
        it on the tensor-parallel mesh where the parameter was one."""
        tp = self._tp[index]
        if tp is None:
            return whole
        _, _, shape, stride = self._meta[index]
        return DTensor.from_local(whole, tp[0], tp[1], run_check=False, shape=shape, stride=stride)

    # -- which tensors the modules hold ---------------------------------------------------

    def use_sharded(self) -> None:
        """The modules hold the sharded ``DTensor`` parameters (between iterations)."""
        self._register(self.sharded)

    @property
    def holders(self) -> list[nn.Module]:
        """The modules that hold the unit's parameters."""
        out: list[nn.Module] = []
        for slots in self._slots:
            for module, _ in slots:
                if not any(module is m for m in out):
                    out.append(module)
        return out

    def to_sharded(self) -> None:
        """Free the unsharded parameters and let the modules hold the sharded ones (before a
        state dict is saved or loaded, as FSDP2 does)."""
        self.free_unsharded()
        self.use_sharded()

    def use_unsharded(self) -> None:
        """The modules hold the unsharded parameters (while they run)."""
        self._register(self.unsharded)

    def _register(self, params: Sequence[nn.Parameter]) -> None:
        for slots, p in zip(self._slots, params):
            for module, name in slots:
                module._parameters[name] = p

    # -- gathering and freeing ------------------------------------------------------------------

    def start_unshard(self, runtime: Runtime) -> None:
        """Issue the gather of every parameter (no-op when gathered or in flight): the padded
        shards copied into this rank's slice of one buffer (cast to the compute dtype), one
        all-gather in place, asynchronously where the runtime allows (a prefetch)."""
        if self.gathered or self._in_flight is not None:
            return
        gathered = torch.empty(self.layout.padded_numel, dtype=self.dtypes.compute, device=self.device)
        if self._post_forward is not None:  # from the smaller group's parts, the full one's slots free
            part, small, size, place = self._post_forward
            self._post_forward = None
            mine = gathered.narrow(0, place * part.numel(), part.numel())
            mine.copy_(part)
            release(part)
            self._in_flight = (gathered, small.all_gather(gathered, mine), size)
            return
        with torch.no_grad():
            mine = copy_in(self.layout, self._padded, gathered, self.rank)
            self._in_flight = (gathered, runtime.all_gather(gathered, mine), self.layout.world)

    def unshard(self, runtime: Runtime) -> None:
        """Gather every parameter into its unsharded tensor (no-op when gathered): wait for the
        all-gather (issuing it first unless a prefetch did), then the copy-out into the unsharded
        parameters' memory."""
        if self.gathered:
            return
        self.start_unshard(runtime)
        assert self._in_flight is not None
        (gathered, pending, ranks), self._in_flight = self._in_flight, None
        for storage, nbytes in zip(self._own_storages, self._own_nbytes):
            storage.resize_(nbytes)
        layout = self.layout
        with torch.no_grad():
            if pending is not None:
                pending.wait()
            # into ``.data``: the unsharded parameters share the stacked tensors' version counter,
            # and autograd's saved references to them must see the new values without a bump
            stacked = [t.data for t in self._stacked]
            if ranks == layout.world:
                copy_out_into(layout, gathered, stacked)
            else:  # each of the smaller group's ranks held a 1/ranks part of every stacked tensor
                parts = [t.numel() // ranks for t in stacked]
                torch.split_with_sizes_copy(
                    gathered.view(ranks, -1), parts, dim=1, out=[t.view(ranks, -1) for t in stacked]
                )
            for i, spec in enumerate(layout.params):
                if spec.shard_dim != 0:
                    chunks = self._stacked[i].chunk(layout.world, dim=0)
                    self._wholes[i].data.copy_(torch.cat(chunks, dim=spec.shard_dim))
        release(gathered)  # now, not when gloo's threads let go of it
        self.gathered = True

    def reshard_post_forward(self, small: Runtime, size: int) -> None:
        """After forward, reshard to the groups of ``size`` ranks ``small`` gathers over (a factor
        of the shard group's; ``reshard_after_forward=size``, ZeRO++'s hpZ) instead of freeing all:
        this rank keeps part ``rank % size`` of every parameter's stacked chunks in one buffer,
        its slot of the smaller all-gather that gathers the unit for backward (FSDP2 keeps the
        same part of each parameter's all-gather output, ``to_sharded_post_forward``)."""
        if not self.gathered:
            return
        place = self.rank % size
        with torch.no_grad():
            part = torch.cat([t.view(size, -1)[place] for t in self._stacked])
        for storage in self._own_storages:
            storage.resize_(0)
        self.gathered = False
        self._post_forward = (part, small, size, place)

    @property
    def post_forward_numel(self) -> int:
        """Elements held resharded to a smaller group after forward (0 when not)."""
        return 0 if self._post_forward is None else self._post_forward[0].numel()

    def free_unsharded(self) -> None:
        """Reshard: the unsharded parameters' memory goes back (``PlanOwner``), and so does a part
        kept for a smaller group's gather; a prefetched all-gather no hook waited for is completed
        and dropped (the next gathers afresh, after the optimizer's step)."""
        if self._post_forward is not None:
            release(self._post_forward[0])
            self._post_forward = None
        if self._in_flight is not None:
            (gathered, pending, _), self._in_flight = self._in_flight, None
            if pending is not None:
                pending.wait()
            release(gathered)
        if not self.gathered:
            return
        for storage in self._own_storages:
            storage.resize_(0)
        self.gathered = False

    # -- gradients ----------------------------------------------------------------------------

    def take_grads(self) -> tuple[torch.Tensor, ...]:
        """The unsharded gradients of the parameters that take them, in the reduce layout's order,
        taken off the unsharded parameters; a zero gradient for one that got none this backward
        (every rank reduces the same buffer whichever parameters its batch used)."""
        out = []
        for i in self.grad_index:
            p = self.unsharded[i]
            g = p.grad
            p.grad = None
            if g is None:
                g = torch.zeros(self._wholes[i].shape, dtype=self.dtypes.compute, device=self.device)
            elif isinstance(g, DTensor):  # tensor parallelism: the local gradient, placed as the parameter
                tp = self._tp[i]
                assert tp is not None
                g = (g if tuple(g.placements) == tp[1] else g.redistribute(placements=tp[1])).to_local()
            out.append(g)
        return tuple(out)

    def restore_pending(self) -> None:
        """Before a backward computes this unit's gradients: unsharded gradients kept from
        ``no_sync`` backwards in the compute dtype go back into the unsharded parameters' ``.grad``,
        so autograd adds the new ones into them in place, as it does for FSDP2's (the plan then
        finds them accumulated, and no second copy is held). Kept in another dtype (the reduce
        dtype), they stay for the plan to add into."""
        pending = self.carried.get(InputRole.PENDING_UNSHARDED)
        if not isinstance(pending, tuple) or any(t.dtype != self.dtypes.compute for t in pending):
            return
        del self.carried[InputRole.PENDING_UNSHARDED]
        for i, g in zip(self.grad_index, pending):
            self.unsharded[i].grad = self._unsharded_value(i, g)

    @property
    def has_grads(self) -> bool:
        """Whether any unsharded parameter got a gradient this backward."""
        return any(self.unsharded[i].grad is not None for i in self.grad_index)

    def reclaim(self) -> None:
        """Before a backward reduces: the reduced gradient the sharded parameters' ``.grad`` show
        becomes the carried ``SHARDED_GRAD`` the plan accumulates into. It is held only through
        those views between steps (so ``zero_grad()`` frees it, as FSDP2's ``.grad`` does): all
        None means there is none; views still of the buffer shown are that buffer; gradients
        assigned or replaced since are copied into a new one, so a ``.grad`` that exists is
        accumulated into as in FSDP2."""
        layout = self.reduce_layout
        self.carried.pop(InputRole.SHARDED_GRAD, None)
        if layout is None:
            return
        grads = [self.sharded[i].grad for i in self.grad_index]
        if all(g is None for g in grads):
            return
        locals_ = [None if g is None else _local(g) for g in grads]
        shown = None if self._shown_base is None else self._shown_base()
        ptrs = tuple(None if t is None else t.data_ptr() for t in locals_)
        if shown is not None and ptrs == self._shown_ptrs:
            self.carried[InputRole.SHARDED_GRAD] = shown
            return
        rebuilt = torch.zeros(layout.slice_numel, dtype=self.dtypes.orig, device=self.device)
        for j, local in enumerate(locals_):
            if local is not None and local.numel():
                offset = layout.shard_offsets[j]
                rebuilt.narrow(0, offset, local.numel()).copy_(local.reshape(-1))
        self.carried[InputRole.SHARDED_GRAD] = rebuilt
        self._show(rebuilt)

    # -- PlanOwner ------------------------------------------------------------------------------

    def expose_views(self, value: Grads, views: tuple[ShardView, ...]) -> None:
        """The reduced gradient becomes the sharded parameters' ``.grad``: each a ``DTensor``
        over its view of ``value`` (FSDP2's ``as_strided`` of the reduce output)."""
        del views  # the plan's views are the reduce layout's, worked out once (``_views``)
        assert isinstance(value, torch.Tensor), "a reduced gradient is one tensor"
        self._show(value)

    def _show(self, reduced: torch.Tensor) -> None:
        ptrs = []
        with torch.no_grad():
            for i, (offset, numel, shape) in zip(self.grad_index, self._views):
                local = reduced.narrow(0, offset, numel).view(shape)
                self.sharded[i].grad = self._dtensor(i, local)
                ptrs.append(local.data_ptr())
        self._shown_base = weakref.ref(reduced)
        self._shown_ptrs = tuple(ptrs)

    def take_carried(self, role: InputRole) -> Grads:
        value = self.carried.pop(role, None)
        if value is None:
            raise RuntimeError(f"the plan takes a carried {role.value} gradient this unit does not hold")
        return value

    def hand_off(self, plan: Plan, value: Grads) -> None:
        """What the plan hands off is carried, but the reduced gradient: the ``.grad`` views
        shown hold it (``reclaim``)."""
        kept = {role: t for role, t in self.carried.items() if role not in plan.consumed}
        if plan.carried_out is not None and plan.carried_out is not InputRole.SHARDED_GRAD:
            kept[plan.carried_out] = value
        self.carried = kept

    def host_grad_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The host buffer an offloaded gradient is copied into (``CPUOffloadPolicy``; asked only
        where the device is not the host)."""
        return torch.empty(numel, dtype=dtype, device="cpu")


def _dtensor_meta(
    spec: ShardedParam, mesh: DeviceMesh, param: torch.Tensor
) -> tuple[DeviceMesh, tuple[Placement, ...], torch.Size, tuple[int, ...]]:
    """A sharded parameter's mesh, placements, global shape and stride, as FSDP2 places it:
    ``Shard(dim)`` on the shard dimension, after ``Replicate()`` on a 2-D mesh. A parameter that is
    already a ``DTensor`` (tensor parallelism) is placed on the data-parallel mesh's dimensions
    followed by its own (their concatenation), its placements after those, and ``Shard`` becomes
    ``_StridedShard`` where its own placements shard the same dimension; its shape and stride are
    the global ones."""
    shard: Placement = Shard(spec.shard_dim)
    if not isinstance(param, DTensor):
        shape = torch.Size(spec.shape)
        stride = torch.empty(shape, device="meta").stride()
        return mesh, ((Replicate(), shard) if mesh.ndim == 2 else (shard,)), shape, stride
    split = param._spec.num_shards_map[spec.shard_dim]
    if split > 1:
        shard = _StridedShard(spec.shard_dim, split_factor=split)
    placements = ((Replicate(), shard) if mesh.ndim == 2 else (shard,)) + tuple(param.placements)
    both = DeviceMesh._concatenate([mesh, param.device_mesh])
    return both, placements, param.shape, tuple(param.stride())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
