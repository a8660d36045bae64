"""Construction-time checks of FullyShardedDataParallel, run inside a gloo world."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._comm_hooks import default_hooks as torch_default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffload as TorchCPUOffload
from torch.distributed.fsdp import FullStateDictConfig as TorchFullStateDictConfig
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
from torch.distributed.fsdp import StateDictType as TorchStateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_core import MixedPrecision, ShardingStrategy
from fsdp_shell import FSDP, comm_hooks


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight


def _half_frozen() -> nn.Module:
    m = nn.Linear(3, 3)
    m.bias.requires_grad_(False)
    return m


def _mixed_dtypes() -> nn.Module:
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    m[1].double()
    return m


def _error(build: Callable[[], object]) -> str:
    try:
        build()
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bad_configurations(rank: int, world: int, _: None) -> dict[str, str]:
    """Each bad configuration's error, as 'Type: message'."""

    def lin() -> nn.Module:
        return nn.Linear(4, 4)

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    pair = (mesh.get_group(1), mesh.get_group(0))

    def hook_with_reduce_dtype() -> None:
        model = FSDP(lin(), mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16))
        model.register_comm_hook(comm_hooks.DefaultState(model.process_group), comm_hooks.fp16_compress_hook)

    def divide_factor(factor: object) -> Callable[[], None]:
        return lambda: FSDP(lin()).set_gradient_divide_factor(factor)  # type: ignore[arg-type]  # bad input on purpose

    def hook_then_divide_factor() -> None:
        model = FSDP(lin())
        model.register_comm_hook(comm_hooks.DefaultState(model.process_group), comm_hooks.allreduce_hook)
        model.set_gradient_divide_factor(2.0)

    solo = [dist.new_group([r]) for r in range(world)]
    solo_again = [dist.new_group([r]) for r in range(world)]
    world_group = dist.group.WORLD
    assert isinstance(world_group, dist.ProcessGroup)

    def hook_twice() -> None:
        model = FSDP(lin())
        model.register_comm_hook(comm_hooks.DefaultState(model.process_group), comm_hooks.reduce_scatter_hook)
        model.register_comm_hook(comm_hooks.DefaultState(model.process_group), comm_hooks.reduce_scatter_hook)

    def hook_after_forward() -> None:
        model = FSDP(lin())
        model(torch.randn(2, 4))
        model.register_comm_hook(comm_hooks.DefaultState(model.process_group), comm_hooks.reduce_scatter_hook)

    def clip(max_norm: object, norm_type: object = 2.0) -> Callable[[], object]:
        return lambda: FSDP(lin()).clip_grad_norm_(max_norm, norm_type)  # type: ignore[arg-type]  # bad input on purpose

    return {
        "hybrid-pair-same-group": _error(
            lambda: FSDP(
                lin(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=(world_group, world_group)
            )
        ),
        "hybrid-pair-not-tiling": _error(
            lambda: FSDP(
                lin(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=(solo[rank], solo_again[rank])
            )
        ),
        "hook-signature": _error(
            lambda: FSDP(lin()).register_comm_hook(
                torch_default_hooks.DefaultState(world_group), torch_default_hooks.allreduce_hook
            )
        ),
        "hook-twice": _error(hook_twice),
        "hook-after-forward": _error(hook_after_forward),
        "clip-negative": _error(clip(-1.0)),
        "clip-nan": _error(clip(float("nan"))),
        "clip-norm-type-negative": _error(clip(1.0, -2.0)),
        "clip-norm-type-string": _error(clip(1.0, "two")),
        "device-id-without-cuda": _error(lambda: FSDP(lin(), device_id=7)),
        "no-parameters": _error(lambda: FSDP(nn.ReLU())),
        "ranks-may-diverge-type": _error(lambda: FSDP(lin(), ranks_may_diverge="yes")),  # type: ignore[arg-type]  # bad input on purpose
        "wrap-policy-bare-class": _error(lambda: FSDP(lin(), auto_wrap_policy=nn.Linear)),
        "strategy": _error(lambda: FSDP(lin(), sharding_strategy="QUARTER_SHARD")),
        "hybrid-without-groups": _error(lambda: FSDP(lin(), sharding_strategy=ShardingStrategy.HYBRID_SHARD)),
        "pair-for-flat": _error(lambda: FSDP(lin(), process_group=pair)),
        "pg-and-mesh": _error(lambda: FSDP(lin(), process_group=pair[0], device_mesh=mesh)),
        "buffer-dtype": _error(lambda: FSDP(lin(), mixed_precision=TorchMixedPrecision(buffer_dtype=torch.int64))),
        "limit-all-gathers-type": _error(lambda: FSDP(lin(), limit_all_gathers="yes")),  # type: ignore[arg-type]  # bad input on purpose
        "ignored-not-iterable": _error(lambda: FSDP(lin(), ignored_modules=nn.Linear(2, 2))),
        "mp-string": _error(lambda: FSDP(lin(), mixed_precision="bf16")),
        "wrap-policy": _error(lambda: FSDP(lin(), auto_wrap_policy=42)),
        "device-id": _error(lambda: FSDP(lin(), device_id="gpu")),
        "use-orig-params": _error(lambda: FSDP(lin(), use_orig_params="yes")),  # type: ignore[arg-type]  # bad input on purpose
        "shared-across-units": _error(lambda: FSDP(Tied(), auto_wrap_policy={nn.Linear})),
        "frozen-beside-trainable-flat": _error(lambda: FSDP(_half_frozen())),
        "state-dict-type": _error(lambda: FSDP.set_state_dict_type(FSDP(lin()), "LOCAL_STATE_DICT")),
        "state-dict-type-local": _error(
            lambda: FSDP.set_state_dict_type(FSDP(lin()), TorchStateDictType.LOCAL_STATE_DICT)
        ),
        "state-dict-config": _error(
            lambda: FSDP.set_state_dict_type(
                FSDP(lin()), TorchStateDictType.SHARDED_STATE_DICT, TorchFullStateDictConfig(rank0_only=True)
            )
        ),
        "load-int-into-float": _error(
            lambda: FSDP(lin()).load_state_dict(
                {"weight": torch.zeros(4, 4, dtype=torch.int64), "bias": torch.zeros(4)}
            )
        ),
        "load-list": _error(lambda: FSDP(lin()).load_state_dict({"weight": [[0.0] * 4] * 4, "bias": torch.zeros(4)})),
        "load-missing-strict": _error(lambda: FSDP(lin()).load_state_dict({"weight": torch.zeros(4, 4)})),
        "mixed-dtypes": _error(lambda: FSDP(_mixed_dtypes())),
        "hook-with-reduce-dtype": _error(hook_with_reduce_dtype),
        "not-a-module": _error(lambda: FSDP("model")),  # type: ignore[arg-type]  # bad input on purpose
        "division-policy": _error(lambda: FSDP(lin(), division_policy="halfway")),
        "divide-factor-zero": _error(divide_factor(0.0)),
        "divide-factor-string": _error(divide_factor("2")),
        "divide-factor-with-hook": _error(hook_then_divide_factor),
        "sync-all-reduce-flat": _error(lambda: FSDP(lin(), hybrid_all_reduce="sync")),
        "all-reduce-placement-type": _error(lambda: FSDP(lin(), hybrid_all_reduce=3)),
        "all-reduce-placement-name": _error(lambda: FSDP(lin(), hybrid_all_reduce="eventually")),
    }


def torch_config_objects(rank: int, world: int, _: None) -> dict[str, str]:
    """torch's own config objects are accepted and mapped by name."""
    model = FSDP(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
        sharding_strategy=TorchStrategy.SHARD_GRAD_OP,
        mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16),
        cpu_offload=TorchCPUOffload(offload_params=False),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    out = model(torch.randn(2, 4))
    out.float().sum().backward()
    wrapped = sum(isinstance(m, FSDP) for m in model.modules())
    default = FSDP(nn.Linear(4, 4), sharding_strategy=None).sharding_strategy  # FSDP1's way of saying the default
    return {
        "strategy": model.sharding_strategy.name,
        "out_dtype": str(out.dtype),
        "units": str(wrapped),
        "none_strategy": default.name,
    }
