"""PyTorch's ``fully_shard`` gathers and reshards as the core's all-gather schedule says, for
``reshard_after_forward`` per unit (the root's own included).

FSDP2 runs under torch's fake process group (one process, nothing communicated) and every
all-gather it issues, every wait on one and every reshard that frees something is recorded at
the hook event it runs in (its param groups' ``pre_forward``, ``post_forward``, ``pre_backward``,
``post_backward``). The schedule ``plan_unshard`` makes from the same recorded orders and the same
per-unit ``forward_reshards`` (with backward prefetch of the next unit, and the post-backward
plan resharding, as FSDP2 does by default) lists the same actions at every event of the second
iteration."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_core import (
    AwaitGather,
    BackwardPrefetch,
    Event,
    Gather,
    Reshard,
    UnshardRequest,
    check_unshard,
    plan_unshard,
)

BLOCKS = 3
"""Units 0..2 are the blocks, unit 3 the root (holding the input and output layers)."""


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(BLOCKS))
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x).relu()
        out: torch.Tensor = self.out(x)
        return out


@pytest.fixture
def fake_rank() -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


Recorded = list[tuple[Event, int, list[tuple[str, int]]]]


def _record(model: nn.Module, units: dict[int, int], monkeypatch: pytest.MonkeyPatch) -> Recorded:
    """FSDP2's effective actions by hook event over the second of two iterations."""
    log: Recorded = []
    events = {
        "pre_forward": Event.PRE_FORWARD,
        "post_forward": Event.POST_FORWARD,
        "pre_backward": Event.PRE_BACKWARD,
        "post_backward": Event.POST_BACKWARD,
    }

    def unit(group: FSDPParamGroup) -> int:
        return units[id(group)]

    for name, event in events.items():
        hook = getattr(FSDPParamGroup, name)

        def at_event(group: FSDPParamGroup, *args: object, _hook: object = hook, _event: Event = event) -> object:
            log.append((_event, unit(group), []))
            return _hook(group, *args)  # type: ignore[operator]  # FSDP2's own method

        monkeypatch.setattr(FSDPParamGroup, name, at_event)
    unshard, wait, reshard = FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard, FSDPParamGroup.reshard

    def gather(group: FSDPParamGroup, async_op: bool = False) -> None:
        if group._all_gather_result is None and not group.is_unsharded:
            log[-1][2].append(("gather", unit(group)))
        unshard(group, async_op)

    def await_gather(group: FSDPParamGroup) -> None:
        if group._all_gather_result is not None:
            log[-1][2].append(("await", unit(group)))
        wait(group)

    def free(group: FSDPParamGroup) -> None:
        was = group.is_unsharded
        reshard(group)
        if was and not group.is_unsharded:
            log[-1][2].append(("reshard", unit(group)))

    monkeypatch.setattr(FSDPParamGroup, "unshard", gather)
    monkeypatch.setattr(FSDPParamGroup, "wait_for_unshard", await_gather)
    monkeypatch.setattr(FSDPParamGroup, "reshard", free)
    x = torch.randn(2, 4)
    for _ in range(2):
        log.clear()
        model(x).sum().backward()
    return log


def _ours(
    recorded: Recorded,
    forward_reshards: tuple[bool, ...],
    forward_prefetches: tuple[tuple[int, ...], ...] = (),
    backward_prefetches: tuple[tuple[int, ...], ...] = (),
) -> Recorded:
    request = UnshardRequest(
        units=BLOCKS + 1,
        root=BLOCKS,
        forward_order=tuple(u for e, u, _ in recorded if e is Event.PRE_FORWARD),
        backward_order=tuple(u for e, u, _ in recorded if e is Event.PRE_BACKWARD),
        reshard_after_forward=True,
        forward_reshards=forward_reshards,
        forward_prefetches=forward_prefetches,
        backward_prefetches=backward_prefetches,
        plan_reshards=True,
        reshard_at_end_of_backward=True,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=False,
    )
    schedule = plan_unshard(request)
    assert check_unshard(schedule) == []
    names = {Gather: "gather", AwaitGather: "await", Reshard: "reshard"}
    out: Recorded = []
    for step in schedule.steps:
        actions = [(names[type(a)], a.unit) for a in step.actions]
        if step.event is Event.POST_BACKWARD and request.plan_reshards:
            actions.append(("reshard", step.unit))  # the post-backward plan's FreeUnshardedParam
        out.append((step.event, step.unit, actions))
    return out


@pytest.mark.parametrize(
    ("blocks", "root", "forward_reshards"),
    [
        (None, None, (True, True, True, False)),
        (False, None, (False, False, False, False)),
        (None, True, (True, True, True, True)),
        ("middle-kept", None, (True, False, True, False)),
    ],
    ids=["defaults", "blocks-keep", "root-reshards-too", "one-block-keeps"],
)
def test_fully_shard_runs_the_planned_schedule(
    blocks: bool | str | None,
    root: bool | None,
    forward_reshards: tuple[bool, ...],
    fake_rank: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = _Net()
    mesh = init_device_mesh("cpu", (2,))
    for i, block in enumerate(model.blocks):
        keep = blocks == "middle-kept" and i == 1
        fully_shard(
            block, mesh=mesh, reshard_after_forward=False if keep else blocks if isinstance(blocks, bool) else None
        )
    fully_shard(model, mesh=mesh, reshard_after_forward=root)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in (*model.blocks, model)]
    recorded = _record(model, {id(g): u for u, g in enumerate(groups)}, monkeypatch)
    assert sum(len(actions) for _, _, actions in recorded) >= 3 * (BLOCKS + 1), recorded
    assert recorded == _ours(recorded, forward_reshards)


def test_explicit_prefetch_lists_run_as_planned(fake_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``: block 0 prefetches
    blocks 1 and 2 in its forward (two units ahead), the root's backward prefetches blocks 2 and
    1, block 1's prefetches block 0; the others keep FSDP2's default backward prefetch."""
    torch.manual_seed(0)
    model = _Net()
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    b0, b1, b2 = model.blocks
    b0.set_modules_to_forward_prefetch([b1, b2])  # type: ignore[operator]  # FSDPModule's, untyped
    model.set_modules_to_backward_prefetch([b2, b1])  # type: ignore[operator]  # FSDPModule's, untyped
    b1.set_modules_to_backward_prefetch([b0])  # type: ignore[operator]  # FSDPModule's, untyped
    groups = [m._get_fsdp_state()._fsdp_param_group for m in (*model.blocks, model)]
    recorded = _record(model, {id(g): u for u, g in enumerate(groups)}, monkeypatch)
    forward = ((1, 2), (), (), ())
    backward = ((), (0,), (), (2, 1))
    assert ("gather", 2) in recorded[1][2], "block 0's forward prefetches two blocks"
    assert recorded == _ours(recorded, (True, True, True, False), forward, backward)
