"""Random plan requests for the properties of every plan (``test_properties_*.py``).

The strategies draw layouts (one huge parameter, or several with and without alignment), world
sizes 1..1024 (hybrid: a divisor of the world as shard size), every strategy, and every
combination of mixed precision, offload, ``use_orig_params``, comm hook, division and step flags
that the constructors accept (``requests``), or any combination at all (``raw_configs``). One
request in four is a per-parameter (``fully_shard``) unit's (``per_param_layouts``): every
sharded strategy, shard dimensions other than 0 where they divide, ``reshard_after_backward``,
an all-reduce hook. ``CI``
and ``LIGHT`` are the properties' hypothesis budgets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import assume
from hypothesis import strategies as st

from fsdp_core import (
    BackendCaps,
    CommHook,
    CPUOffload,
    Division,
    DivisionPolicy,
    FlatParamLayout,
    HybridAllReduce,
    MixedPrecision,
    PerParamLayout,
    Plan,
    PlanRequest,
    ShardingSpec,
    ShardingStrategy,
    StepFlags,
    plan_post_backward,
)
from tests.budget import budget

CI = budget(200)
"""The main property's budget: 200 examples (``tests.budget``)."""
LIGHT = budget(100)
"""The cheaper properties."""

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
FLAG_NAMES = (
    "sync_gradients",
    "accumulate",
    "pending_unsharded",
    "requires_all_reduce",
    "pending_partial",
    "force_full_precision",
)

dtypes = st.sampled_from(DTYPES)
optional_dtypes = st.none() | dtypes


# -- strategies ----------------------------------------------------------------------------

shapes = st.lists(st.integers(min_value=0, max_value=40), max_size=3).map(tuple) | st.tuples(
    st.integers(min_value=1, max_value=100_000)
)


@st.composite
def layouts(draw: st.DrawFn) -> FlatParamLayout:
    """One parameter of up to 1e10 elements, or up to 8 small ones, aligned or not."""
    dtype = draw(dtypes)
    if draw(st.booleans()):
        n = draw(st.integers(min_value=1, max_value=10**10))
        return FlatParamLayout.of([("w", (n,))], dtype)
    params = draw(st.lists(shapes, min_size=1, max_size=8))
    assume(any(math.prod(s) > 0 for s in params))
    align = draw(st.booleans())
    align_dtype = draw(optional_dtypes) if align else None
    return FlatParamLayout.of(
        [(f"layer{i}.p", s) for i, s in enumerate(params)], dtype, align=align, align_dtype=align_dtype
    )


@st.composite
def per_param_layouts(draw: st.DrawFn, world: int) -> PerParamLayout:
    """Up to 6 parameters of 1 to 3 dimensions (sizes 0..40, or one of up to 1e5 rows), each
    sharded on dimension 0 or, where its size there divides over ``world``, another one."""
    dtype = draw(dtypes)
    entries: list[tuple[str, tuple[int, ...], int]] = []
    for i in range(draw(st.integers(min_value=1, max_value=6))):
        shape = draw(st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=3).map(tuple) | shapes)
        if not shape:
            shape = (1,)
        dims = [0, *(d for d in range(1, len(shape)) if shape[d] % world == 0)]
        entries.append((f"layer{i}.p", shape, draw(st.sampled_from(dims))))
    assume(any(math.prod(s) > 0 for _, s, _ in entries))
    return PerParamLayout.of(entries, dtype, world)


world_sizes = st.sampled_from([1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256, 512, 1024]) | st.integers(
    min_value=1, max_value=1024
)


@st.composite
def shardings(draw: st.DrawFn, strategy: ShardingStrategy | None = None) -> ShardingSpec:
    """A strategy, a world of 1..1024 ranks (hybrid: a divisor as shard size) and a rank."""
    strat = draw(st.sampled_from(ShardingStrategy)) if strategy is None else strategy
    world = draw(world_sizes)
    shard: int | None = None
    if strat.is_hybrid:
        shard = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    rank = draw(st.integers(min_value=0, max_value=(shard or world) - 1))
    return ShardingSpec.for_world(strat, world, shard, rank=rank)


mixed_precisions = st.builds(
    MixedPrecision, param_dtype=optional_dtypes, reduce_dtype=optional_dtypes, keep_low_precision_grads=st.booleans()
)
backends = st.builds(BackendCaps, supports_avg=st.booleans(), supports_premul_sum=st.booleans())
user_factors = (
    st.none() | st.integers(min_value=1, max_value=4096).map(float) | st.floats(min_value=1e-3, max_value=1e6)
)


def weighted(true_in_20: int) -> st.SearchStrategy[bool]:
    """A bool that is True about ``true_in_20`` times in 20, so rare states are drawn but
    ordinary synchronised steps dominate."""
    return st.integers(min_value=0, max_value=19).map(lambda n: n < true_in_20)


FLAG_WEIGHTS = {
    "sync_gradients": 16,
    "accumulate": 6,
    "pending_unsharded": 4,
    "requires_all_reduce": 13,
    "pending_partial": 5,
    "force_full_precision": 3,
}
flag_values = st.tuples(*(weighted(FLAG_WEIGHTS[name]) for name in FLAG_NAMES))


@st.composite
def requests(draw: st.DrawFn) -> PlanRequest:
    """A valid request: every drawn combination is mapped onto one the constructors accept,
    so every valid combination stays reachable."""
    if draw(weighted(5)):
        return draw(per_param_requests())
    layout = draw(layouts())
    sharding = draw(shardings())
    strategy = sharding.strategy
    mp = draw(mixed_precisions)
    hooks = [
        h
        for h in CommHook
        if not (h is CommHook.REDUCE_SCATTER and not strategy.is_sharded)
        and not (h.is_low_precision and mp.reduce_dtype is not None)
    ]
    hook = draw(st.just(CommHook.NONE) | st.sampled_from(hooks))
    factor = draw(user_factors) if hook is CommHook.NONE else None
    division = Division(policy=draw(st.sampled_from(DivisionPolicy)), backend=draw(backends), factor=factor)
    f = dict(zip(FLAG_NAMES, draw(flag_values)))
    if not strategy.is_hybrid:
        f["requires_all_reduce"] = True
        f["pending_partial"] = False
    use_orig_params = draw(st.booleans())
    placement = draw(st.sampled_from(HybridAllReduce)) if strategy.is_hybrid else HybridAllReduce.ASYNC
    request = PlanRequest(
        layout=layout,
        sharding=sharding,
        mixed_precision=mp,
        offload=CPUOffload(offload_params=draw(st.booleans())),
        comm_hook=hook,
        division=division,
        use_orig_params=use_orig_params,
        flags=StepFlags(**f),
        hybrid_all_reduce=placement,
    )
    assume(not hits_hybrid_hook_premul_bug(request))
    return request


@st.composite
def per_param_requests(draw: st.DrawFn) -> PlanRequest:
    """A valid per-parameter (``fully_shard``) request: a sharded strategy, the layout sharded
    over its shard group, no comm hook, ``use_orig_params`` or low-precision gradients (refused
    there), ``reshard_after_backward`` and ``all_reduce_hook`` any."""
    sharding = draw(shardings(draw(st.sampled_from([s for s in ShardingStrategy if s.is_sharded]))))
    mp = draw(mixed_precisions.map(lambda m: MixedPrecision(param_dtype=m.param_dtype, reduce_dtype=m.reduce_dtype)))
    f = dict(zip(FLAG_NAMES, draw(flag_values)))
    if not sharding.strategy.is_hybrid:
        f["requires_all_reduce"] = True
        f["pending_partial"] = False
    division = Division(policy=draw(st.sampled_from(DivisionPolicy)), backend=draw(backends), factor=draw(user_factors))
    return PlanRequest(
        layout=draw(per_param_layouts(sharding.shard_size)),
        sharding=sharding,
        mixed_precision=mp,
        offload=CPUOffload(offload_params=draw(st.booleans())),
        division=division,
        flags=StepFlags(**f),
        hybrid_all_reduce=draw(st.sampled_from(HybridAllReduce))
        if sharding.strategy.is_hybrid
        else HybridAllReduce.ASYNC,
        reshard_after_backward=draw(st.none() | st.booleans()),
        all_reduce_hook=draw(st.booleans()),
    )


def hits_hybrid_hook_premul_bug(r: PlanRequest) -> bool:
    """The known planner bug of ``test_hybrid_comm_hook_with_premul_only_backend_divides_fully``
    (excluded here so the properties keep checking everything else)."""
    backend = r.division.backend
    return (
        r.comm_hook is not CommHook.NONE
        and r.sharding.strategy.is_hybrid
        and r.sharding.replicate_size > 1
        and r.division.policy is DivisionPolicy.IN_COLLECTIVE
        and backend.supports_premul_sum
        and not backend.supports_avg
        and r.reduce_dtype in (torch.float32, torch.bfloat16, torch.float64)
    )


@dataclass(frozen=True)
class RawConfig:
    """Descriptors drawn with no regard for which combinations are valid."""

    layout: FlatParamLayout
    sharding: ShardingSpec
    mp: MixedPrecision
    offload: bool
    hook: CommHook
    division: Division
    use_orig_params: bool
    flags: dict[str, bool]

    def plan(self) -> Plan:
        return plan_post_backward(
            self.layout,
            self.sharding,
            mixed_precision=self.mp,
            offload=CPUOffload(offload_params=self.offload),
            comm_hook=self.hook,
            division=self.division,
            use_orig_params=self.use_orig_params,
            flags=StepFlags(**self.flags),
        )


raw_configs = st.builds(
    RawConfig,
    layout=layouts(),
    sharding=shardings(),
    mp=mixed_precisions,
    offload=st.booleans(),
    hook=st.sampled_from(CommHook),
    division=st.builds(Division, policy=st.sampled_from(DivisionPolicy), backend=backends, factor=user_factors),
    use_orig_params=st.booleans(),
    flags=flag_values.map(lambda values: dict(zip(FLAG_NAMES, values))),
)
