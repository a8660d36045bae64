"""(f) Planning is deterministic: equal requests made of fresh descriptors are equal and hash
alike, build equal plans, and hit the same plan in the cache. Requests are drawn by ``properties_cases``.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given

from fsdp_core import FlatParamLayout, ParamSpec, PerParamLayout, PlanCache, PlanRequest, ShardedParam, build_plan
from tests.core.properties_cases import LIGHT, requests

# -- (f) determinism and caching -----------------------------------------------------------


def rebuilt(r: PlanRequest) -> PlanRequest:
    """An equal request made of freshly constructed descriptors."""
    old = r.layout
    layout: FlatParamLayout | PerParamLayout
    if isinstance(old, FlatParamLayout):
        layout = FlatParamLayout(
            params=tuple(ParamSpec(name=p.name, shape=tuple(p.shape)) for p in old.params),
            dtype=old.dtype,
            alignment_numel=old.alignment_numel,
        )
    else:
        layout = PerParamLayout(
            params=tuple(ShardedParam(name=p.name, shape=tuple(p.shape), shard_dim=p.shard_dim) for p in old.params),
            dtype=old.dtype,
            world=old.world,
        )
    return dataclasses.replace(
        r,
        layout=layout,
        sharding=dataclasses.replace(r.sharding),
        mixed_precision=dataclasses.replace(r.mixed_precision),
        division=dataclasses.replace(r.division),
        flags=dataclasses.replace(r.flags),
    )


@LIGHT
@given(requests())
def test_planning_is_deterministic_hashable_and_cached(request: PlanRequest) -> None:
    twin = rebuilt(request)
    assert twin == request and twin is not request and hash(twin) == hash(request)
    first, second = build_plan(request), build_plan(twin)
    assert first == second
    assert hash(first) == hash(second)
    cache = PlanCache()
    cached = cache(request)
    assert cached == first
    assert cache(twin) is cached
