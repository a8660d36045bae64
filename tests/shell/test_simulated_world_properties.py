"""Properties over random configurations, run over a simulated world: any strategy, mesh, layout,
mixed precision, comm hook, division, offload, ``use_orig_params`` and step flags hands each rank
its shard of the average; any sequence of microbatches (``no_sync``, a deferred all-reduce,
accumulation into an existing gradient) averages their sum.

Expected values come from ``simulated_world_cases``: plain torch, in float64, from the gradients
handed to the ranks, with offsets, shard sizes and FSDP1's pre-divide factors written out by hand;
nothing expected is computed by the planner, the layout or the division code under test. Which
dtype reduces, travels and is handed off is worked out in each test from the configuration, by
hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import Tensor

from fsdp_core import (
    CommHook,
    CPUOffload,
    Destination,
    Device,
    Division,
    DivisionPolicy,
    FlatParamLayout,
    MixedPrecision,
    PlanRequest,
    ShardingStrategy,
    StepFlags,
)
from tests.budget import budget
from tests.shell.simulated_world_cases import (
    BF16,
    F16,
    F32,
    F64,
    GLOO,
    HYBRID,
    NCCL,
    SS,
    LayoutCase,
    Mesh,
    assert_averaged,
    assert_views_rebuild_the_params,
    make_grads,
    mean_over_world,
    run,
    shard_numel,
    summed,
)

# -- properties ------------------------------------------------------------------------------


ALIGNMENT_NUMEL = {F64: 2, F32: 4, F16: 8, BF16: 8}
"""16 bytes in elements of each compute dtype."""


def lowest_precision(dtypes: set[torch.dtype]) -> torch.dtype:
    return next(d for d in (BF16, F16, F32, F64) if d in dtypes)


@budget(200)
@given(
    strategy=st.sampled_from(list(SS)),
    shard=st.integers(1, 4),
    replicate=st.integers(1, 3),
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=3).filter(lambda s: sum(s) > 0),
    orig=st.sampled_from([F32, F64, BF16]),
    mp=st.sampled_from(
        [
            MixedPrecision(),
            MixedPrecision(param_dtype=BF16, reduce_dtype=F32),
            MixedPrecision(param_dtype=F16),
            MixedPrecision(param_dtype=F16, reduce_dtype=BF16),
            MixedPrecision(reduce_dtype=BF16, keep_low_precision_grads=True),
            MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True),
            MixedPrecision(param_dtype=BF16, reduce_dtype=F16, keep_low_precision_grads=True),
        ]
    ),
    hook=st.sampled_from(list(CommHook)),
    division=st.sampled_from(
        [
            Division(),
            Division(factor=3.0),
            Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL),
            Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=7.0),
            Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO),
        ]
    ),
    offload=st.booleans(),
    use_orig_params=st.booleans(),
    accumulate=st.booleans(),
    pending=st.booleans(),
    force_full_precision=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_configuration_averages(
    strategy: ShardingStrategy,
    shard: int,
    replicate: int,
    sizes: list[int],
    orig: torch.dtype,
    mp: MixedPrecision,
    hook: CommHook,
    division: Division,
    offload: bool,
    use_orig_params: bool,
    accumulate: bool,
    pending: bool,
    force_full_precision: bool,
    seed: int,
) -> None:
    mesh = Mesh(strategy, shard, replicate if strategy in HYBRID else 1)
    compute = orig if force_full_precision or mp.param_dtype is None else mp.param_dtype
    if force_full_precision:
        reduce = orig
    elif hook in (CommHook.FP16_COMPRESS, CommHook.BF16_COMPRESS):
        reduce = compute
    else:
        reduce = mp.reduce_dtype or compute
    handed = reduce if mp.keep_low_precision_grads and not force_full_precision else orig
    wire = {CommHook.FP16_COMPRESS: F16, CommHook.BF16_COMPRESS: BF16}.get(hook, reduce)

    params = tuple((f"p{i}", (n,)) for i, n in enumerate(sizes))
    offsets, total = [], 0
    for n in sizes:
        if use_orig_params:
            total += -total % ALIGNMENT_NUMEL[compute]
        offsets.append(total)
        total += n
    layout = FlatParamLayout.of(params, orig, align=use_orig_params, align_dtype=compute)
    try:
        request = PlanRequest(
            layout=layout,
            sharding=mesh.spec(),
            mixed_precision=mp,
            offload=CPUOffload(offload_params=offload),
            comm_hook=hook,
            division=division,
            use_orig_params=use_orig_params,
            flags=StepFlags(
                accumulate=accumulate, pending_unsharded=pending, force_full_precision=force_full_precision
            ),
        )
    except ValueError:
        assume(False)
    grads = make_grads(mesh.world, total, compute, seed=seed)
    pending_grads = make_grads(mesh.world, total, compute, seed=seed + 1) if pending else None
    existing = make_grads(mesh.world, shard_numel(mesh, total), handed, seed=seed + 2) if accumulate else None
    result = run(request, grads, pending_unsharded=pending_grads, sharded_grads=existing)

    precision = lowest_precision({compute, reduce, wire, handed})
    destination = (
        Destination.CPU_GRAD if offload else Destination.ACCUMULATED_GRAD if accumulate else Destination.SHARDED_GRAD
    )
    summed_grads = summed(grads, pending_grads) if pending_grads is not None else grads
    full = mean_over_world(summed_grads, division.factor)
    assert_averaged(
        result,
        mesh,
        full,
        precision=precision,
        dtype=handed,
        destination=destination,
        device=Device.HOST if offload else Device.DEVICE,
        existing=existing,
    )
    assert [c.hook for r in result.ranks for c in r.hook_calls] == (
        [] if hook is CommHook.NONE else [hook] * mesh.world
    )
    if use_orig_params and not accumulate:
        case = LayoutCase("generated", params, tuple(offsets), total)
        assert_views_rebuild_the_params(result, mesh, case, full, precision)


@budget(100)
@given(
    strategy=st.sampled_from(list(SS)),
    shard=st.integers(1, 4),
    replicate=st.integers(1, 3),
    numel=st.integers(1, 20),
    mp=st.sampled_from(
        [
            MixedPrecision(),
            MixedPrecision(param_dtype=BF16, reduce_dtype=F32),
            MixedPrecision(param_dtype=F16, keep_low_precision_grads=True),
        ]
    ),
    hook=st.sampled_from([CommHook.NONE, CommHook.ALLREDUCE, CommHook.USER, CommHook.BF16_COMPRESS]),
    division=st.sampled_from(
        [
            Division(),
            Division(factor=3.0),
            Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL),
            Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=7.0),
            Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO),
        ]
    ),
    offload=st.booleans(),
    accumulate=st.booleans(),
    no_sync_steps=st.integers(0, 2),
    deferred_steps=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_any_sequence_of_microbatches_averages_their_sum(
    strategy: ShardingStrategy,
    shard: int,
    replicate: int,
    numel: int,
    mp: MixedPrecision,
    hook: CommHook,
    division: Division,
    offload: bool,
    accumulate: bool,
    no_sync_steps: int,
    deferred_steps: int,
    seed: int,
) -> None:
    """``no_sync_steps`` backwards inside ``no_sync``, then (hybrid only) ``deferred_steps`` backwards
    keeping a partial, then one that reduces everything, optionally into an existing gradient."""
    mesh = Mesh(strategy, shard, replicate if strategy in HYBRID else 1)
    if strategy not in HYBRID:
        deferred_steps = 0
    compute = mp.param_dtype or F32
    reduce = compute if hook is CommHook.BF16_COMPRESS else mp.reduce_dtype or compute
    handed = reduce if mp.keep_low_precision_grads else F32
    wire = BF16 if hook is CommHook.BF16_COMPRESS else reduce
    layout = FlatParamLayout.of((("w", (numel,)),), F32)
    try:
        base = PlanRequest(
            layout=layout,
            sharding=mesh.spec(),
            mixed_precision=mp,
            offload=CPUOffload(offload_params=offload),
            comm_hook=hook,
            division=division,
        )
    except ValueError:
        assume(False)
    steps = [StepFlags(sync_gradients=False, pending_unsharded=i > 0) for i in range(no_sync_steps)]
    steps += [
        StepFlags(requires_all_reduce=False, pending_unsharded=i == 0 and no_sync_steps > 0, pending_partial=i > 0)
        for i in range(deferred_steps)
    ]
    steps.append(
        StepFlags(
            accumulate=accumulate,
            pending_unsharded=no_sync_steps > 0 and deferred_steps == 0,
            pending_partial=deferred_steps > 0,
        )
    )
    all_grads = [make_grads(mesh.world, numel, compute, seed=seed + i) for i in range(len(steps))]
    existing = make_grads(mesh.world, shard_numel(mesh, numel), handed, seed=seed - 1) if accumulate else None
    carried: Sequence[Tensor] | None = None
    for flags, grads in zip(steps[:-1], all_grads):
        result = run(
            replace(base, flags=flags),
            grads,
            pending_unsharded=carried if flags.pending_unsharded else None,
            partials=carried if flags.pending_partial else None,
        )
        carried = result.grads
    final = steps[-1]
    result = run(
        replace(base, flags=final),
        all_grads[-1],
        pending_unsharded=carried if final.pending_unsharded else None,
        partials=carried if final.pending_partial else None,
        sharded_grads=existing,
    )
    destination = (
        Destination.CPU_GRAD if offload else Destination.ACCUMULATED_GRAD if accumulate else Destination.SHARDED_GRAD
    )
    assert_averaged(
        result,
        mesh,
        mean_over_world(summed(*all_grads), division.factor),
        precision=lowest_precision({compute, reduce, wire, handed}),
        dtype=handed,
        destination=destination,
        device=Device.HOST if offload else Device.DEVICE,
        existing=existing,
    )
