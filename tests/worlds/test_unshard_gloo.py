"""``fsdp-plan`` shows the all-gather schedule the runtime records, verifies and runs.

One 2-rank gloo world trains the 20 combinations of strategy (5) x ``no_sync`` or not x fp32 or
bf16 compute, each a root wrapping two units, one iteration each. The request the runtime
records on that iteration (``UnshardRunner``), its unit indices renamed in forward order, equals
the one ``fsdp-plan --units 3`` builds for the same options, and so does the schedule planned
from it: both come from ``fsdp_core.unshard_request``. Before, the runtime's request said the
plans reshard in backward wherever the strategy shards, ``fsdp-plan``'s where the plan does; they
differed in 6 of the 20.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

from fsdp_core import ShardingStrategy, UnshardRequest, UnshardSchedule, check_unshard, plan_unshard
from fsdp_shell import FSDP, MixedPrecision
from fsdp_shell.cli.plan import build_parser, plan_from_args, unshard_from_args
from tests.worlds.dist_harness import run_world

COMBOS = list(itertools.product(ShardingStrategy, (True, False), (torch.float32, torch.bfloat16)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.tanh(self.lin(x))
        return out


def _in_forward_order(request: UnshardRequest) -> UnshardRequest:
    rename = {u: i for i, u in enumerate(request.forward_order)}
    return dataclasses.replace(
        request,
        root=rename[request.root],
        forward_order=tuple(rename[u] for u in request.forward_order),
        backward_order=tuple(rename[u] for u in request.backward_order),
    )


def recorded_requests(rank: int, world: int, arg: None) -> list[UnshardRequest]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    out = []
    for strategy, sync, dtype in COMBOS:
        torch.manual_seed(0)
        mp = MixedPrecision(param_dtype=dtype) if dtype != torch.float32 else None
        model = FSDP(
            nn.Sequential(nn.Linear(4, 4), Block(), Block(), nn.Linear(4, 1)),
            auto_wrap_policy={Block},
            sharding_strategy=strategy,
            mixed_precision=mp,
            device_mesh=mesh if strategy.is_hybrid else None,
        )
        x = torch.randn(2, 4)
        if sync:
            model(x).float().sum().backward()
        else:
            with model.no_sync():
                model(x).float().sum().backward()
        schedule = model._tree.unshard.schedule
        assert check_unshard(schedule) == [], (strategy, sync, dtype)
        out.append(schedule.request)
    return out


def fsdp_plan_schedule(strategy: ShardingStrategy, sync: bool, dtype: torch.dtype) -> UnshardSchedule | None:
    argv = ["--strategy", strategy.name, "--world-size", "2", "--units", "3"]
    if dtype != torch.float32:
        argv += ["--param-dtype", "bfloat16"]
    if not sync:
        argv.append("--no-sync")
    args = build_parser().parse_args(argv)
    return unshard_from_args(args, plan_from_args(args))


def test_fsdp_plan_shows_the_schedule_the_runtime_records_for_all_20_combinations() -> None:
    recorded = run_world(2, recorded_requests, None, timeout=240)
    assert recorded[0] == recorded[1]
    for (strategy, sync, dtype), request in zip(COMBOS, recorded[0], strict=True):
        case = f"{strategy.name}, sync={sync}, {dtype}"
        runtime = _in_forward_order(request)
        assert runtime.forward_order == (0, 1, 2) and runtime.backward_order == (0, 2, 1), case
        shown = fsdp_plan_schedule(strategy, sync, dtype)
        if shown is None:
            # fsdp-plan shows none where nothing is ever gathered, and the runtime frees nothing
            assert strategy is ShardingStrategy.NO_SHARD and dtype == torch.float32, case
            assert not runtime.reshard_after_forward and not runtime.plan_reshards, case
            continue
        assert shown.request == runtime, case
        assert shown == plan_unshard(runtime), case
