"""(e) Every plan's communication volume matches the ring closed form, over random requests, and a
worked example. Requests are drawn by ``properties_cases``. Expected values are written out here,
never computed with the function under test.
"""

from __future__ import annotations

import torch
from hypothesis import given

from fsdp_core import (
    CommHook,
    FlatParamLayout,
    Group,
    PerParamLayout,
    PlanRequest,
    ShardingSpec,
    ShardingStrategy,
    build_plan,
    comm_volume,
    plan_post_backward,
)
from tests.core.properties_cases import CI, requests


def cdiv(a: int, b: int) -> int:
    """Exact ``ceil(a / b)`` for the closed forms below (written here, not imported)."""
    return (a + b - 1) // b


# -- (e) communication volume --------------------------------------------------------------

Expected = tuple[str, Group, int, int, torch.dtype, int]
"""(collective, group, group size, input numel, wire dtype, bytes per rank)."""


def ring_reduce_scatter(group: int, chunk: int, dtype: torch.dtype) -> int:
    return 0 if group == 1 else (group - 1) * chunk * dtype.itemsize


def ring_all_reduce(group: int, numel: int, dtype: torch.dtype) -> int:
    return 0 if group == 1 else 2 * (group - 1) * cdiv(numel, group) * dtype.itemsize


def expected_collectives(r: PlanRequest) -> list[Expected]:
    """The closed form: which collectives each strategy issues and what each rank sends."""
    if not r.flags.sync_gradients:
        return []
    g, rep = r.sharding.shard_size, r.sharding.replicate_size
    total = r.layout.total_numel
    param_dtype = r.layout.dtype if r.flags.force_full_precision else (r.mixed_precision.param_dtype or r.layout.dtype)
    if r.comm_hook.wire_dtype is not None:
        reduce_dtype = param_dtype
    elif r.flags.force_full_precision:
        reduce_dtype = r.layout.dtype
    else:
        reduce_dtype = r.mixed_precision.reduce_dtype or param_dtype
    wire = r.comm_hook.wire_dtype or reduce_dtype
    if r.sharding.strategy is ShardingStrategy.NO_SHARD:
        return [("all_reduce", Group.SHARD, g, total, wire, ring_all_reduce(g, total, wire))]
    # a flat parameter is split evenly; a per-parameter unit's rank sends its slice (each
    # parameter's padded chunk)
    chunk = r.layout.slice_numel if isinstance(r.layout, PerParamLayout) else cdiv(total, g)
    out: list[Expected]
    if r.comm_hook is CommHook.ALLREDUCE:
        out = [("all_reduce", Group.SHARD, g, chunk * g, wire, ring_all_reduce(g, chunk * g, wire))]
    else:
        out = [("reduce_scatter", Group.SHARD, g, chunk * g, wire, ring_reduce_scatter(g, chunk, wire))]
    if r.sharding.strategy.is_hybrid and r.flags.requires_all_reduce:
        out.append(("all_reduce", Group.REPLICATE, rep, chunk, reduce_dtype, ring_all_reduce(rep, chunk, reduce_dtype)))
    return out


@CI
@given(requests())
def test_comm_volume_matches_the_ring_closed_form(request: PlanRequest) -> None:
    plan = build_plan(request)
    got = [(v.collective, v.group, v.group_size, v.input_numel, v.dtype, v.bytes) for v in comm_volume(plan)]
    assert got == expected_collectives(request)


def test_comm_volume_worked_example() -> None:
    """HYBRID_SHARD, 1001 fp32 elements, shards of 8 in a world of 32: the reduce-scatter sends
    7 x 126 x 4 = 3528 bytes; the all-reduce of 126 over 4 ranks sends 2 x 3 x 32 x 4 = 768."""
    layout = FlatParamLayout.of([("w", (1001,))], torch.float32)
    plan = plan_post_backward(layout, ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 32, 8))
    assert [(v.collective, v.bytes) for v in comm_volume(plan)] == [("reduce_scatter", 3528), ("all_reduce", 768)]
