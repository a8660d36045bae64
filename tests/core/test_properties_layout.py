"""(b) Padding is minimal and (c) the shard views of all ranks partition every parameter, for
random layouts and shardings, drawn by ``properties_cases``. Expected values are written out
here, never computed with the function under test.
"""

from __future__ import annotations

from hypothesis import given

from fsdp_core import FlatParamLayout, Pad, ReduceScatter, ShardingSpec, ShardingStrategy, plan_post_backward
from tests.core.properties_cases import LIGHT, layouts, shardings

# -- (b) padding, (c) shard views ----------------------------------------------------------


@LIGHT
@given(layouts(), shardings())
def test_padding_is_minimal(layout: FlatParamLayout, sharding: ShardingSpec) -> None:
    total = layout.total_numel
    shards = sharding.num_shards
    padded = sharding.padded_numel(layout)
    assert shards == (1 if sharding.strategy is ShardingStrategy.NO_SHARD else sharding.shard_size)
    assert padded % shards == 0
    assert 0 <= padded - total < shards
    assert sharding.shard_numel(layout) * shards == padded

    plan = plan_post_backward(layout, sharding)
    pads = [op for op in plan.ops if isinstance(op, Pad)]
    if sharding.strategy.is_sharded and padded != total:
        assert [(p.src.numel, p.dst.numel) for p in pads] == [(total, padded)]
    else:
        assert pads == []
    reduce_scatters = [op for op in plan.ops if isinstance(op, ReduceScatter)]
    if sharding.strategy.is_sharded:
        assert [(r.src.numel, r.dst.numel) for r in reduce_scatters] == [(padded, padded // shards)]


@LIGHT
@given(layouts(), shardings())
def test_shard_views_of_all_ranks_partition_every_parameter(layout: FlatParamLayout, sharding: ShardingSpec) -> None:
    shard_numel = sharding.shard_numel(layout)
    pieces: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(layout.params))}
    for rank in range(sharding.num_shards):
        base = rank * shard_numel if sharding.strategy.is_sharded else 0
        for v in sharding.shard_views(layout, rank):
            param = layout.params[v.param_index]
            assert v.param_name == param.name
            assert v.numel > 0
            assert v.offset_in_buffer >= 0 and v.offset_in_buffer + v.numel <= shard_numel
            assert v.offset_in_param >= 0 and v.offset_in_param + v.numel <= param.numel
            # the element's place in the flat parameter, seen from the shard and from the layout
            assert base + v.offset_in_buffer == layout.offsets[v.param_index] + v.offset_in_param
            pieces[v.param_index].append((v.offset_in_param, v.numel))
    for index, param in enumerate(layout.params):
        covered = 0
        for start, numel in sorted(pieces[index]):
            assert start == covered, f"{param.name}: gap or overlap at {covered}"
            covered += numel
        assert covered == param.numel
