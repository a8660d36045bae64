"""Which device a tree runs on and the runtime for it: the one place that chooses between the
CPU runtime and the accelerator runtime."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdp_shell.runtime.accelerator import AcceleratorRuntime, TorchDevice
from fsdp_shell.runtime.collectives import CollectiveLog
from fsdp_shell.runtime.cpu import CpuRuntime
from fsdp_shell.runtime.groups import ProcessGroups
from fsdp_shell.runtime.protocol import Runtime

__all__ = [
    "RuntimeFactory",
    "checked_device_id",
    "current_accelerator",
    "default_device",
    "make_runtime",
    "set_cpu_runtime",
]

RuntimeFactory = Callable[[ProcessGroups, CollectiveLog], Runtime]
"""Makes the runtime of a tree from its process groups and its collective log."""

_factories: dict[str, RuntimeFactory] = {}
"""Runtime factories that replace the built-in runtime, by device type (``set_cpu_runtime``)."""


def current_accelerator() -> torch.device | None:
    """This machine's accelerator (``cuda``, ``xpu``, ...), None where there is none."""
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


def _accelerator_type() -> str:
    """The type of this machine's accelerator (``cuda`` where there is none, as FSDP1 assumes)."""
    accelerator = current_accelerator()
    return "cuda" if accelerator is None else accelerator.type


def checked_device_id(device_id: object) -> torch.device | None:
    """``device_id`` as FSDP1 takes it (None, an index of the accelerator, a ``torch.device``),
    checked against this machine before any process group is touched."""
    if device_id is None:
        return None
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        device_id = torch.device(_accelerator_type(), device_id)
    if not isinstance(device_id, torch.device):
        raise TypeError(f"device_id: expected None, an int or a torch.device, got {device_id!r}")
    if device_id.type != "cpu":
        available = torch.accelerator.is_available() and _accelerator_type() == device_id.type
        count = torch.accelerator.device_count() if available else 0
        if count == 0:
            raise ValueError(
                f"device_id: {device_id} names a {device_id.type.upper()} device, but "
                f"{device_id.type.upper()} is not available here; pass None or torch.device('cpu')"
            )
        if device_id.index is not None and not 0 <= device_id.index < count:  # pragma: no cover  (needs an accelerator)
            raise ValueError(
                f"device_id: {device_id} does not exist; this machine has {device_id.type.upper()} "
                f"devices 0..{count - 1}"
            )
    return device_id


def default_device(groups: ProcessGroups) -> torch.device:
    """FSDP1's default without ``device_id``: the current accelerator device when the process
    group's backend is not gloo (NCCL on CUDA), else the CPU."""
    if groups.backend != "gloo" and torch.accelerator.is_available():  # pragma: no cover  (needs an accelerator)
        return torch.device(_accelerator_type(), torch.accelerator.current_device_index())
    return torch.device("cpu")


def set_cpu_runtime(factory: RuntimeFactory | None) -> None:
    """Trees built on the CPU from now on get their runtime from ``factory`` instead of the CPU
    runtime (None restores it). For checkers that run the accelerator runtime on CPU tensors,
    such as the test suite's checked-streams device."""
    if factory is None:
        _factories.pop("cpu", None)
    else:
        _factories["cpu"] = factory


def make_runtime(device: torch.device, groups: ProcessGroups, log: CollectiveLog) -> Runtime:
    """Device streams for the plan streams on an accelerator; the host thread and the lane on the
    CPU, where the lane also issues shard-group reductions when the all-gathers have a group of
    their own (then a reduction queued behind a sync all-reduce does not block the host)."""
    if device.type != "cpu":  # pragma: no cover  (needs an accelerator)
        return AcceleratorRuntime(groups, log, TorchDevice(device))
    factory = _factories.get("cpu")
    if factory is not None:
        return factory(groups, log)
    return CpuRuntime(groups, log, lane_issues_shard=groups.gather is not None)
