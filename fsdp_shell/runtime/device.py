"""Which device a tree runs on and the runtime for it: the one place that chooses between the
CPU and CUDA runtimes."""

from __future__ import annotations

import torch

from fsdp_shell.runtime.cpu import CpuRuntime
from fsdp_shell.runtime.cuda import CudaRuntime
from fsdp_shell.runtime.groups import ProcessGroups
from fsdp_shell.runtime.log import CollectiveLog
from fsdp_shell.runtime.protocol import Runtime

__all__ = ["checked_device_id", "default_device", "make_runtime"]


def checked_device_id(device_id: object) -> torch.device | None:
    """``device_id`` as FSDP1 takes it (None, a CUDA index, a ``torch.device``), checked against
    this machine before any process group is touched."""
    if device_id is None:
        return None
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        device_id = torch.device("cuda", device_id)
    if not isinstance(device_id, torch.device):
        raise TypeError(f"device_id: expected None, an int or a torch.device, got {device_id!r}")
    if device_id.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"device_id: {device_id} names a CUDA device, but CUDA is not available here; "
                "pass None or torch.device('cpu')"
            )
        if device_id.index is not None and not 0 <= device_id.index < count:
            raise ValueError(f"device_id: {device_id} does not exist; this machine has CUDA devices 0..{count - 1}")
    return device_id


def default_device(groups: ProcessGroups) -> torch.device:
    """FSDP1's default without ``device_id``: the current CUDA device with NCCL, else the CPU."""
    if groups.backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_runtime(device: torch.device, groups: ProcessGroups, log: CollectiveLog) -> Runtime:
    """CUDA streams for the plan streams on a GPU; the host thread and the lane on the CPU, where
    the lane also issues shard-group reductions when the all-gathers have a group of their own
    (then a reduction queued behind a sync all-reduce does not block the host)."""
    if device.type == "cuda":
        return CudaRuntime(groups, log, device)
    return CpuRuntime(groups, log, lane_issues_shard=groups.gather is not None)
