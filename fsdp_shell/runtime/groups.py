"""Resolve FSDP's process groups from ``process_group`` / ``device_mesh`` and check them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import assert_never

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_core import BackendCaps, Group, ShardingStrategy

__all__ = ["ProcessGroups", "duplicate_group", "group_timeout", "resolve_groups"]


@dataclass(frozen=True)
class ProcessGroups:
    """The shard group (FSDP's process group), for hybrid strategies the replicate group, and
    optionally a group of the shard group's ranks for the all-gathers alone."""

    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None
    gather: dist.ProcessGroup | None = None

    def of(self, group: Group) -> dist.ProcessGroup:
        """The process group a plan names ``group``."""
        match group:
            case Group.SHARD:
                return self.shard
            case Group.REPLICATE:
                if self.replicate is None:
                    raise RuntimeError(
                        f"a plan names the replicate group, but {self.shard_size} ranks shard without one"
                    )
                return self.replicate
            case _:
                assert_never(group)

    @property
    def gather_group(self) -> dist.ProcessGroup:
        """Where the all-gathers run: their own group if there is one, else the shard group."""
        return self.shard if self.gather is None else self.gather

    @property
    def shard_size(self) -> int:
        return self.shard.size()

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate is None else self.replicate.size()

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.shard)).lower()

    @property
    def caps(self) -> BackendCaps:
        name = self.backend
        return BackendCaps.for_backend(name) if name in ("nccl", "gloo") else BackendCaps()


def group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """How long a collective of ``group`` waits for the other ranks before its backend gives up
    (``init_process_group(timeout=...)``, ``new_group(timeout=...)``); None where the backend
    does not say."""
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        timeout = getattr(options, "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def duplicate_group(group: dist.ProcessGroup, backend: str | None = None) -> dist.ProcessGroup:
    """A new group of the same ranks as ``group`` (of ``backend``, default the default one), so
    that two threads can each issue collectives in their own order (every rank of the world must
    call this: ``new_group`` is collective, so each rank creates every rank's duplicate, in one
    agreed order)."""
    mine = dist.get_process_group_ranks(group)
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    duplicate: dist.ProcessGroup | None = None
    for ranks in sorted({tuple(r) for r in everyone if r is not None}):
        created = dist.new_group(list(ranks), backend=backend)
        if list(ranks) == mine:
            duplicate = created
    assert isinstance(duplicate, dist.ProcessGroup)
    return duplicate


def _hybrid_default(device_type: str) -> ProcessGroups:
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local < 1 or world % local:
        raise ValueError(
            "process_group: hybrid strategies need (shard_group, replicate_group), a 2-D device_mesh, "
            "or LOCAL_WORLD_SIZE (set by torchrun) dividing the world size"
        )
    mesh = init_device_mesh(device_type, (world // local, local), mesh_dim_names=("replicate", "shard"))
    return ProcessGroups(shard=mesh.get_group(1), replicate=mesh.get_group(0))


def resolve_groups(
    strategy: ShardingStrategy,
    process_group: object,
    device_mesh: object,
    device_type: str,
) -> ProcessGroups:
    """The groups for ``strategy``; raises ``ValueError``/``TypeError`` naming the argument."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("FullyShardedDataParallel needs torch.distributed.init_process_group() first")
    if process_group is not None and device_mesh is not None:
        raise ValueError("process_group, device_mesh: pass one of them, not both")
    if device_mesh is not None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"device_mesh: expected a DeviceMesh, got {device_mesh!r}")
        if device_mesh.ndim == 1:
            groups = ProcessGroups(shard=device_mesh.get_group(0), replicate=None)
        elif device_mesh.ndim == 2:
            groups = ProcessGroups(shard=device_mesh.get_group(1), replicate=device_mesh.get_group(0))
        else:
            raise ValueError(f"device_mesh: expected 1-D (shard) or 2-D (replicate, shard), got {device_mesh.ndim}-D")
    elif isinstance(process_group, tuple):
        if len(process_group) != 2 or not all(isinstance(g, dist.ProcessGroup) for g in process_group):
            raise TypeError("process_group: expected a ProcessGroup or a (shard_group, replicate_group) pair")
        groups = ProcessGroups(shard=process_group[0], replicate=process_group[1])
    elif isinstance(process_group, dist.ProcessGroup):
        groups = ProcessGroups(shard=process_group, replicate=None)
    elif process_group is None:
        if strategy.is_hybrid:
            return _hybrid_default(device_type)
        world = dist.group.WORLD
        assert isinstance(world, dist.ProcessGroup)
        groups = ProcessGroups(shard=world, replicate=None)
    else:
        raise TypeError(f"process_group: expected a ProcessGroup, a pair of them, or None, got {process_group!r}")
    if strategy.is_hybrid and groups.replicate is None:
        raise ValueError(
            f"process_group: {strategy.name} needs a replicate group: pass (shard_group, replicate_group) "
            "or a 2-D device_mesh"
        )
    if not strategy.is_hybrid and groups.replicate is not None:
        raise ValueError(
            f"process_group: {strategy.name} takes one group; a (shard, replicate) pair or 2-D mesh needs "
            "HYBRID_SHARD or HYBRID_SHARD_ZERO2"
        )
    if groups.replicate is not None:
        _check_tiling(groups.shard, groups.replicate)
    return groups


def _check_tiling(shard: dist.ProcessGroup, replicate: dist.ProcessGroup) -> None:
    """A hybrid pair must tile the world: this rank is the only rank in both groups, and shard
    size x replicate size is the world size (that every rank's pair fits the others' is checked
    across ranks at the first forward, ``fsdp_shell.safety.agreement``)."""
    me = dist.get_rank()
    s, r = dist.get_process_group_ranks(shard), dist.get_process_group_ranks(replicate)
    world = dist.get_world_size()
    if (shard is replicate and len(s) > 1) or set(s) & set(r) != {me}:
        raise ValueError(
            f"process_group: the shard group {s} and the replicate group {r} must share exactly "
            f"this rank ({me}); pass (shard_group, replicate_group) from a 2-D layout, e.g. "
            "init_device_mesh(..., (replicas, shard_size)).get_group(1), .get_group(0)"
        )
    if len(s) * len(r) != world:
        raise ValueError(
            f"process_group: shard size {len(s)} x replicate size {len(r)} = {len(s) * len(r)} "
            f"ranks, but the world has {world}; the pair must tile the world"
        )
