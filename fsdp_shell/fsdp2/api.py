"""``fully_shard`` and ``FSDPModule``: PyTorch's FSDP2 API (torch 2.13's names, arguments and
objects) on this library's plans.

``fully_shard(module)`` shards the parameters the module manages (its own and its
descendants', except those under a module ``fully_shard`` was applied to before, and
``ignored_params``) as one per-parameter unit (``fsdp_shell.fsdp2.group``), hooks the module's
forward (``fsdp_shell.fsdp2.state``), and changes its class to ``FSDP<Class>``, an
``FSDPModule``. What is not supported is refused at the call, naming the argument or method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, cast, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from fsdp_core import unit_dtypes
from fsdp_shell.fsdp2.group import ParamGroup
from fsdp_shell.fsdp2.state import FSDPState, lazy_init, state_of
from fsdp_shell.fsdp2.units import Slot, managed_params, per_param_layout

__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "fully_shard",
    "post_forward_mesh",
    "register_fsdp_forward_method",
]

_CLASSES: dict[type, type] = {}
_NO_MIXED_PRECISION = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()
_DEFAULT_MESH: dict[int, tuple[object, DeviceMesh]] = {}
"""The mesh of ``mesh=None`` calls, by the default process group it spans: one for every call,
so their units share one runtime (FSDP2 makes one per call)."""
_POST_FORWARD_MESH: dict[tuple[int, str, tuple[int, ...], int], tuple[object, DeviceMesh]] = {}


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
    offload_policy: OffloadPolicy = _NO_OFFLOAD,
    ignored_params: set[nn.Parameter] | None = None,
) -> FSDPModule | list[FSDPModule]:
    """Shard ``module``'s parameters over ``mesh`` (1-D: FSDP; 2-D ``(replicate, shard)``: HSDP)
    as PyTorch's ``fully_shard`` does, and return it, its class now ``FSDP<Class>``."""
    modules = tuple(module) if isinstance(module, list) else (module,)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"module: expected an nn.Module or a non-empty list of them, got {module!r}")
    for m in modules:
        if state_of(m) is not None:
            raise ValueError(f"module: fully_shard was already applied to {type(m).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed.init_process_group() first")
    mesh = _mesh(mesh)
    reshard_after_forward = _reshard_after_forward(reshard_after_forward, mesh)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy: expected torch.distributed.fsdp.MixedPrecisionPolicy, got {mp_policy!r}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy: expected torch.distributed.fsdp.OffloadPolicy, got {offload_policy!r}")
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    if offload and mesh.device_type != "cpu":
        raise NotImplementedError(
            f"offload_policy: CPUOffloadPolicy on a {mesh.device_type} mesh is not supported by fsdp_shell's "
            "fully_shard yet (on a CPU mesh it is)"
        )
    if isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory:
        raise ValueError(
            "offload_policy: pin_memory=True pins for an accelerator this CPU mesh has not; pass "
            "CPUOffloadPolicy(pin_memory=False)"
        )
    ignored = set() if ignored_params is None else set(ignored_params)
    params, slots, names = _managed(modules, ignored, mesh)
    group = None
    if params:
        group = _group(params, slots, names, mesh, shard_placement_fn, mp_policy)
    small = None
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        small = post_forward_mesh(mesh, reshard_after_forward)
    state = FSDPState(modules, group, mesh, mp_policy, offload=offload, post_forward_mesh=small)
    state.change(reshard_after_forward=reshard_after_forward)
    for m in modules:
        m.__class__ = _fsdp_class(type(m))
    return cast("FSDPModule | list[FSDPModule]", module)


def _mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        world = dist.group.WORLD
        cached = _DEFAULT_MESH.get(id(world))
        if cached is None or cached[0] is not world:  # one per default group, as long as it lives
            cached = _DEFAULT_MESH[id(world)] = (world, init_device_mesh(_device_type(), (dist.get_world_size(),)))
        return cached[1]
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh: expected a DeviceMesh, got {mesh!r}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"mesh: expected a 1-D (shard) or 2-D (replicate, shard) DeviceMesh, got {mesh.ndim}-D")
    return mesh


def _reshard_after_forward(value: object, mesh: DeviceMesh) -> bool | int | None:
    """``reshard_after_forward`` checked: None, a bool, or the size of the groups to reshard to
    after forward, a factor of the shard group's (1 is False, the shard group's size True, as in
    FSDP2)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward: expected None, a bool or an int, got {value!r}")
    size = mesh.size(mesh.ndim - 1)
    if not 1 <= value <= size or size % value:
        raise ValueError(
            f"reshard_after_forward: an int is the size of the groups to reshard to after forward, a factor of "
            f"the shard group's {size} ranks; got {value}"
        )
    return False if value == 1 else True if value == size else value


def post_forward_mesh(mesh: DeviceMesh, size: int) -> DeviceMesh:
    """The 1-D mesh of this rank's group of ``size`` consecutive ranks of its shard group (FSDP2's
    post-forward mesh, ``mesh.mesh.view(-1, size)``), one per mesh and size while the default
    process group lives (making one is collective: every rank calls ``fully_shard`` alike)."""
    world = dist.group.WORLD
    key = (id(world), mesh.device_type, tuple(mesh.mesh.flatten().tolist()), size)
    cached = _POST_FORWARD_MESH.get(key)
    if cached is None or cached[0] is not world:
        names = ("post_forward_replicate", "post_forward_shard")
        small = DeviceMesh(mesh.device_type, mesh.mesh.view(-1, size), mesh_dim_names=names)
        cached = _POST_FORWARD_MESH[key] = (world, small["post_forward_shard"])
    return cached[1]


def _device_type() -> str:
    """The default mesh's device: the CPU under gloo, else the current accelerator."""
    if str(dist.get_backend()).lower() == "gloo":
        return "cpu"
    accelerator = torch.accelerator.current_accelerator()  # pragma: no cover  (needs an accelerator)
    return "cpu" if accelerator is None else accelerator.type  # pragma: no cover


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())  # pragma: no cover


def _check_tp(name: str, param: DTensor, mesh: DeviceMesh) -> None:
    """A parameter that is already a ``DTensor`` (tensor parallelism) is sharded on ``mesh`` over
    its local tensor: its own mesh must be 1-D, another part of the same mesh as ``mesh``."""
    if param.device_mesh.ndim != 1:
        raise NotImplementedError(
            f"module: parameter {name!r} is a DTensor on a {param.device_mesh.ndim}-D mesh; fsdp_shell's "
            "fully_shard composes with 1-D tensor parallelism only"
        )
    try:
        DeviceMesh._concatenate([mesh, param.device_mesh])
    except RuntimeError as error:
        raise ValueError(
            f"mesh: parameter {name!r} is a DTensor on a mesh that is not another dimension of the same "
            f"DeviceMesh as mesh ({error}); pass mesh=world_mesh['dp'] and parallelize with world_mesh['tp']"
        ) from error


def _managed(
    modules: tuple[nn.Module, ...], ignored: set[nn.Parameter], mesh: DeviceMesh
) -> tuple[list[nn.Parameter], list[list[Slot]], list[str]]:
    """``managed_params`` for a ``fully_shard`` call, each DTensor checked for ``mesh``."""
    params, slots, names = managed_params(modules, ignored, lambda m: state_of(m) is not None)
    for p, name in zip(params, names):
        if isinstance(p, DTensor):
            _check_tp(name, p, mesh)
    return params, slots, names


def _group(
    params: list[nn.Parameter],
    slots: list[list[Slot]],
    names: list[str],
    mesh: DeviceMesh,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
    mp: MixedPrecisionPolicy,
) -> ParamGroup:
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(
            f"module: the parameters of one fully_shard call must share one dtype, got {sorted(map(str, dtypes))}; "
            "shard the modules of each dtype with their own call"
        )
    layout = per_param_layout(params, names, mesh.size(mesh.ndim - 1), shard_placement_fn)
    device = (
        torch.device("cpu")
        if mesh.device_type == "cpu"
        else torch.device(mesh.device_type, torch.accelerator.current_device_index())
    )
    return ParamGroup(
        params, slots, layout, unit_dtypes(params[0].dtype, mp.param_dtype, mp.reduce_dtype), mesh, device
    )


def _fsdp_class(cls: type) -> type:
    if issubclass(cls, FSDPModule):
        return cls
    made = _CLASSES.get(cls)
    if made is None:
        made = _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return made


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` until the parameters are
    gathered (here they are by the time it returns)."""

    def wait(self) -> None:
        return None


class FSDPModule:
    """The methods a module gets from ``fully_shard``, with FSDP2's names and meaning."""

    def _state(self) -> FSDPState:
        state = state_of(cast(nn.Module, self))
        if state is None:
            raise RuntimeError("this FSDPModule has no fully_shard state")
        return state

    def _states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._state()]
        out: list[FSDPState] = []
        for m in cast(nn.Module, self).modules():
            s = state_of(m)
            if s is not None and s not in out:
                out.append(s)
        return out

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather the module's parameters (the module then holds the unsharded ones)."""
        state = self._state()
        ctx = lazy_init(state)
        if state.group is not None:
            state.group.unshard(ctx.runtime(state.mesh))  # the root's, for this mesh
            state.group.use_unsharded()
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Free the module's unsharded parameters (not recursive)."""
        group = self._state().group
        if group is not None:
            group.free_unsharded()
            group.use_sharded()

    def _set(self, recurse: bool, name: str, value: bool) -> None:
        """One boolean setting, on this module's state and (``recurse``) every one under it."""
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {value!r}")
        for s in self._states(recurse):
            s.change(**{name: value})

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduces gradients (False: accumulate unsharded, FSDP2's ``no_sync``)."""
        self._set(recurse, "requires_gradient_sync", requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward all-reduces across replicas (False: keep the partial reduction)."""
        self._set(recurse, "requires_all_reduce", requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the modules free their unsharded parameters after forward."""
        self._set(recurse, "reshard_after_forward", reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether the modules free their unsharded parameters after backward."""
        self._set(recurse, "reshard_after_backward", reshard_after_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the reduced gradient's sum by ``factor`` instead of the data-parallel size."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"factor: expected a number > 0, got {factor!r}")
        self._state().change(gradient_divide_factor=float(factor))

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with ``SUM`` only and divide outside the collectives."""
        _bool("enable", enable)
        self._state().change(force_sum_reduction_for_comms=enable)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted: every backward here finishes its reductions by its end, which is what
        ``is_last_backward=True`` asks of FSDP2; False lets FSDP2 defer that wait, with the same
        gradients."""
        _bool("is_last_backward", is_last_backward)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True is what this library always does (a unit that got any gradient reduces zeros for
        its unused parameters, so every rank's collectives pair); False is refused."""
        _bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        if not reduce_scatter_unused_params:
            raise NotImplementedError(
                "set_reduce_scatter_unused_params: False (leave unused parameters out of a rank's "
                "reduce-scatter, which pairs the ranks' collectives wrongly when they differ, PyTorch issue "
                "158719) is not supported; fsdp_shell reduces them as zeros"
            )

    def reset_iter_state(self) -> None:
        """Drop the iteration in progress after an exception aborted it (on the root)."""
        state = self._state()
        if state.ctx is not None:
            from fsdp_shell.fsdp2.state import abandon_backward

            abandon_backward(state.ctx)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """After gathering its own parameters in forward, this module issues the all-gathers of
        ``modules`` (each waited for at that module's forward)."""
        self._state().forward_prefetch = _states_of("modules", modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """After gathering its own parameters in backward, this module issues the all-gathers of
        ``modules`` (each waited for at that module's backward)."""
        self._state().backward_prefetch = _states_of("modules", modules)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: object = None) -> None:
        """Call ``hook(grad)`` on this module's reduced gradient every step it is reduced (not
        recursive), in place: the reduce-scatter's output (after the replicate all-reduce on a 2-D
        mesh) in the reduce dtype, divided, as FSDP2 shows it for fp32 and bf16 (FSDP2 shows fp16,
        or sums forced by ``set_force_sum_reduction_for_comms``, before part of the division). It
        runs on the all-reduce stream; on the CPU on the host thread once the reduction is done."""
        if not callable(hook):
            raise TypeError(f"hook: expected a callable taking the reduced gradient, got {hook!r}")
        if stream is not None:
            raise NotImplementedError(
                "set_all_reduce_hook: stream (a stream of the caller's for the hook) is not supported by "
                "fsdp_shell's fully_shard yet; the hook runs on the all-reduce stream"
            )
        self._state().change_hook(hook)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The root's next forward makes its all-gathers wait for ``event`` (recorded after the
        optimizer's step), then drops it: call it with a new event every step. On a CPU mesh there
        is no stream to order: the step is done when forward starts."""
        if not isinstance(event, torch.Event):
            raise TypeError(f"event: expected a torch.Event recorded after the optimizer step, got {event!r}")
        self._state().post_optim_event = event

    def set_custom_all_gather(self, comm: object) -> NoReturn:
        _unsupported("set_custom_all_gather", "custom collectives")

    def set_custom_reduce_scatter(self, comm: object) -> NoReturn:
        _unsupported("set_custom_reduce_scatter", "custom collectives")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward reads none of this module's parameters (an embedding), so they are not
        gathered for it (not recursive)."""
        self._set(False, "unshard_in_backward", unshard_in_backward)


def _states_of(name: str, modules: object) -> tuple[FSDPState, ...]:
    if not isinstance(modules, list | tuple):
        raise TypeError(f"{name}: expected a list of FSDPModules, got {modules!r}")
    states = []
    for m in modules:
        s = state_of(m) if isinstance(m, nn.Module) else None
        if s is None:
            raise ValueError(f"{name}: every entry must be a module fully_shard was applied to, got {type(m).__name__}")
        states.append(s)
    return tuple(states)


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")


def _unsupported(method: str, what: str) -> NoReturn:
    raise NotImplementedError(f"FSDPModule.{method}: {what} is not supported by fsdp_shell's fully_shard yet")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` with the module's pre- and post-forward hooks around it (for
    methods other than ``forward``, such as Hugging Face's ``generate``), as FSDP2's function does."""
    state = state_of(module)
    if state is None:
        raise ValueError(f"module: expected a module fully_shard was applied to, got {type(module).__name__}")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"method_name: {type(module).__name__} has no method {method_name!r}")
    from fsdp_shell.fsdp2.state import _post_forward, _pre_forward

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _pre_forward(state, module, args, kwargs)
        return _post_forward(state, module, args, kwargs, method(*args, **kwargs))

    setattr(module, method_name, wrapped)
