"""``limit_all_gathers``: a real rate limiter of the unsharded buffers a host may run ahead with.

On the checked accelerator (``tests.device.checked_streams``: streams and events with vector clocks,
every op checked for races), a four-unit ``FULL_SHARD`` model trains three steps on 2 gloo
ranks. The runtime logs every free marker, every host wait on one and every all-gather. With
``limit_all_gathers=True`` (FSDP1's default) every all-gather is issued with at most one free
still owed by the device, and the host did wait; with False no marker is recorded and the host
never waits. The losses are the same either way and equal the single-process reference's; the
plain CPU runtime, whose frees are done when they return, has nothing to limit.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from fsdp_shell import FSDP
from fsdp_shell.runtime.accelerator import AcceleratorRuntime
from fsdp_shell.runtime.collectives import CollectiveLog, Pending, Waitable
from fsdp_shell.runtime.device import set_cpu_runtime
from fsdp_shell.runtime.groups import ProcessGroups
from tests.device.checked_streams import CheckedDevice, CheckedEvent, CheckedStream, StreamChecker
from tests.worlds.dist_harness import run_world


class _Logged:
    def __init__(self, marker: Waitable, index: int, log: list[tuple[str, int]]) -> None:
        self._marker = marker
        self._index = index
        self._log = log

    def wait(self) -> None:
        self._log.append(("waited", self._index))
        self._marker.wait()


class LoggingRuntime(AcceleratorRuntime[CheckedStream, CheckedEvent]):
    def __init__(self, groups: ProcessGroups, log: CollectiveLog, device: CheckedDevice) -> None:
        super().__init__(groups, log, device)
        self.events: list[tuple[str, int]] = []
        self._frees = 0

    def free_marker(self) -> Waitable:
        self._frees += 1
        self.events.append(("free", self._frees))
        return _Logged(super().free_marker(), self._frees, self.events)

    def all_gather(self, out: torch.Tensor, src: torch.Tensor) -> Pending | None:
        self.events.append(("gather", 0))
        return super().all_gather(out, src)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)), nn.Linear(6, 1))


def _train(model: nn.Module, rank: int, world: int) -> list[float]:
    """Three SGD steps, this rank's share of each batch; the mean loss over ``world`` ranks
    (``world`` 1: the whole batch, no collective)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        mine = x[rank * 4 // world : (rank + 1) * 4 // world]
        loss = model(mine).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def limited(rank: int, world: int, limit: bool) -> dict[str, object]:
    checker = StreamChecker()
    runtimes: list[LoggingRuntime] = []

    def runtime(groups: ProcessGroups, log: CollectiveLog) -> LoggingRuntime:
        made = LoggingRuntime(groups, log, CheckedDevice(checker))
        runtimes.append(made)
        return made

    set_cpu_runtime(runtime)
    try:
        with checker:
            model = FSDP(_model(), auto_wrap_policy={nn.Sequential}, limit_all_gathers=limit)
            losses = _train(model, rank, world)
    finally:
        set_cpu_runtime(None)
    (events,) = [r.events for r in runtimes]
    owed: list[int] = []
    freed, waited = 0, set()
    for kind, index in events:
        if kind == "free":
            freed += 1
        elif kind == "waited":
            waited.add(index)
        else:
            owed.append(freed - len(waited))
    ref = _model()
    plain = FSDP(copy.deepcopy(ref), auto_wrap_policy={nn.Sequential}, limit_all_gathers=limit)
    return {
        "losses": losses,
        "plain": _train(plain, rank, world),
        "reference": _train(ref, 0, 1),
        "gathers": len(owed),
        "most_owed": max(owed),
        "frees": freed,
        "waits": len(waited),
        "ops": checker.ops_checked,
    }


def test_limit_all_gathers_bounds_the_frees_the_device_owes() -> None:
    on = run_world(2, limited, True, timeout=180)
    off = run_world(2, limited, False, timeout=180)
    for with_limit, without in zip(on, off):
        assert with_limit["gathers"] == without["gathers"] and int(with_limit["gathers"]) >= 15  # type: ignore[call-overload]  # an int
        assert with_limit["most_owed"] == 1 and int(with_limit["waits"]) > 0  # type: ignore[call-overload]  # an int
        assert int(with_limit["frees"]) >= int(with_limit["gathers"]) - 1  # type: ignore[call-overload]  # ints
        assert without["frees"] == 0 and without["waits"] == 0
        assert with_limit["losses"] == without["losses"] == with_limit["plain"]
        reference = with_limit["reference"]
        assert isinstance(reference, list)
        assert all(abs(a - b) < 1e-6 for a, b in zip(with_limit["losses"], reference))  # type: ignore[call-overload]  # lists of float
        assert int(with_limit["ops"]) > 300  # type: ignore[call-overload]  # an int
