"""Descriptors: layouts, shard bounds and views worked out by hand; bad input fails at construction."""

from __future__ import annotations

import pytest
import torch

from fsdp_core import (
    CARRIED_ROLES,
    CommHook,
    CPUOffload,
    Destination,
    FlatParamLayout,
    InputRole,
    MixedPrecision,
    ParamSpec,
    PlanRequest,
    ShardingSpec,
    ShardingStrategy,
    ShardView,
    StepFlags,
    carried_role,
    step_flags,
)
from fsdp_core.spec.layout import ShardBounds

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def test_alignment_padding_is_inserted_before_unaligned_parameters() -> None:
    layout = FlatParamLayout.of([("a", (5,)), ("b", (3,)), ("c", (4,))], F32, align=True)
    # fp32: 4 elements per 16 bytes. a 0..5, pad 5..8, b 8..11, pad 11..12, c 12..16.
    assert layout.alignment_numel == 4
    assert layout.offsets == (0, 8, 12)
    assert layout.total_numel == 16
    assert layout.numel_without_padding == 12
    unaligned = FlatParamLayout.of([("a", (5,)), ("b", (3,)), ("c", (4,))], F32)
    assert unaligned.offsets == (0, 5, 8) and unaligned.total_numel == 12


def test_shard_bounds_and_padding_of_1001_over_8() -> None:
    layout = FlatParamLayout.of([("w", (1001,))], F32)
    sharding = ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 8)
    assert sharding.shard_numel(layout) == 126 and sharding.padded_numel(layout) == 1008
    bounds = sharding.all_bounds(layout)
    assert bounds[0] == ShardBounds(rank=0, start=0, end=126, padding=0)
    assert bounds[7] == ShardBounds(rank=7, start=882, end=1001, padding=7)


def test_more_ranks_than_elements_leaves_empty_shards() -> None:
    layout = FlatParamLayout.of([("w", (5,))], F32)
    sharding = ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 4)
    # shard size 2: ranks hold 0..2, 2..4, 4..5 (+1 pad), nothing (+2 pad), as torch.chunk does.
    assert [(b.start, b.end, b.padding) for b in sharding.all_bounds(layout)] == [
        (0, 2, 0),
        (2, 4, 0),
        (4, 5, 1),
        (5, 5, 2),
    ]
    assert sharding.shard_views(layout, 3) == ()


def test_shard_views_split_parameters_across_ranks() -> None:
    layout = FlatParamLayout.of([("a", (2, 3)), ("b", (4,))], F32)  # a 0..6, b 6..10
    sharding = ShardingSpec.for_world(ShardingStrategy.SHARD_GRAD_OP, 3)  # shards of 4: 0..4, 4..8, 8..10
    assert sharding.shard_views(layout, 0) == (
        ShardView(param_index=0, param_name="a", offset_in_buffer=0, offset_in_param=0, numel=4),
    )
    assert sharding.shard_views(layout, 1) == (
        ShardView(param_index=0, param_name="a", offset_in_buffer=0, offset_in_param=4, numel=2),
        ShardView(param_index=1, param_name="b", offset_in_buffer=2, offset_in_param=0, numel=2),
    )
    assert sharding.shard_views(layout, 2) == (
        ShardView(param_index=1, param_name="b", offset_in_buffer=0, offset_in_param=2, numel=2),
    )


def test_no_shard_has_one_shard_of_everything() -> None:
    layout = FlatParamLayout.of([("w", (1001,))], F32)
    sharding = ShardingSpec.for_world(ShardingStrategy.NO_SHARD, 4, rank=3)
    assert sharding.num_shards == 1 and sharding.shard_numel(layout) == 1001 == sharding.padded_numel(layout)
    assert sharding.data_parallel_size == 4


def test_mixed_precision_dtype_rules() -> None:
    mp = MixedPrecision(param_dtype=BF16)
    assert mp.compute_dtype(F32) is BF16 and mp.reduce_dtype_for(F32) is BF16
    assert MixedPrecision(reduce_dtype=F16).reduce_dtype_for(F32) is F16
    assert MixedPrecision(reduce_dtype=F16).compute_dtype(F32) is F32
    assert mp.reduce_dtype_for(F32, force_full_precision=True) is F32


@pytest.mark.parametrize(
    ("build", "error", "fragment"),
    [
        (lambda: MixedPrecision(param_dtype=torch.int8), TypeError, "mixed_precision.param_dtype"),
        (lambda: MixedPrecision(reduce_dtype="bf16"), TypeError, "mixed_precision.reduce_dtype"),  # type: ignore[arg-type]  # bad input on purpose
        (lambda: CPUOffload(offload_params=1), TypeError, "cpu_offload.offload_params"),  # type: ignore[arg-type]  # bad input on purpose
        (lambda: ParamSpec(name="", shape=(1,)), ValueError, "name"),
        (lambda: ParamSpec(name="w", shape=(-1,)), ValueError, "shape"),
        (lambda: FlatParamLayout.of([("w", (0,))], F32), ValueError, "no elements"),
        (lambda: FlatParamLayout.of([("w", (1,)), ("w", (2,))], F32), ValueError, "duplicate"),
        (lambda: FlatParamLayout.of([("w", (1,))], torch.int64), TypeError, "dtype"),
        (lambda: ShardingSpec(strategy=ShardingStrategy.FULL_SHARD, shard_size=0), ValueError, "shard_size"),
        (
            lambda: ShardingSpec(strategy=ShardingStrategy.FULL_SHARD, shard_size=4, replicate_size=2),
            ValueError,
            "replicate_size",
        ),
        (lambda: ShardingSpec(strategy=ShardingStrategy.FULL_SHARD, shard_size=4, rank=4), ValueError, "rank"),
        (lambda: ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 6, 4), ValueError, "does not divide"),
        (lambda: ShardingStrategy.parse("ZERO3"), ValueError, "accepted"),
        (lambda: CommHook.parse("int8"), ValueError, "accepted"),
        (lambda: StepFlags(sync_gradients=0), TypeError, "flags.sync_gradients"),  # type: ignore[arg-type]  # bad input on purpose
    ],
)
def test_bad_input_fails_at_construction_naming_the_argument(
    build: object, error: type[Exception], fragment: str
) -> None:
    assert callable(build)
    with pytest.raises(error, match=fragment):
        build()


def test_request_rejects_impossible_combinations() -> None:
    layout = FlatParamLayout.of([("w", (8,))], F32)
    full = ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 2)
    with pytest.raises(ValueError, match="pending_partial"):
        PlanRequest(layout=layout, sharding=full, flags=StepFlags(pending_partial=True))
    with pytest.raises(TypeError, match="mixed_precision"):
        PlanRequest(layout=layout, sharding=full, mixed_precision=None)  # type: ignore[arg-type]  # bad input on purpose


def test_strategy_parse_accepts_fsdp1_spellings() -> None:
    assert ShardingStrategy.parse("hybrid_shard") is ShardingStrategy.HYBRID_SHARD
    assert ShardingStrategy.parse("_HYBRID_SHARD_ZERO2") is ShardingStrategy.HYBRID_SHARD_ZERO2
    assert ShardingStrategy.parse("shard-grad-op") is ShardingStrategy.SHARD_GRAD_OP


# -- carried gradient state ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("destination", "role"),
    [
        (Destination.SHARDED_GRAD, InputRole.SHARDED_GRAD),
        (Destination.ACCUMULATED_GRAD, InputRole.SHARDED_GRAD),
        (Destination.CPU_GRAD, InputRole.SHARDED_GRAD),
        (Destination.UNSHARDED_GRAD, InputRole.PENDING_UNSHARDED),
        (Destination.PARTIAL, InputRole.PENDING_PARTIAL),
    ],
)
def test_carried_role_of_every_destination(destination: Destination, role: InputRole) -> None:
    assert carried_role(destination) is role


def test_carried_roles_are_every_role_but_the_new_gradient() -> None:
    assert {InputRole.SHARDED_GRAD, InputRole.PENDING_UNSHARDED, InputRole.PENDING_PARTIAL} == CARRIED_ROLES
    assert {carried_role(d) for d in Destination} == CARRIED_ROLES


def test_step_flags_say_which_carried_buffers_exist() -> None:
    assert step_flags(frozenset(), sync_gradients=True, requires_all_reduce=True) == StepFlags()
    every = frozenset({InputRole.SHARDED_GRAD, InputRole.PENDING_UNSHARDED, InputRole.PENDING_PARTIAL})
    assert step_flags(every, sync_gradients=False, requires_all_reduce=False, force_full_precision=True) == StepFlags(
        sync_gradients=False,
        accumulate=True,
        pending_unsharded=True,
        requires_all_reduce=True,  # inside no_sync nothing is reduced, so no all-reduce is deferred
        pending_partial=True,
        force_full_precision=True,
    )
    deferred = step_flags(frozenset(), sync_gradients=True, requires_all_reduce=False)
    assert deferred == StepFlags(requires_all_reduce=False)
    only_partial = step_flags(frozenset({InputRole.PENDING_PARTIAL}), sync_gradients=True, requires_all_reduce=True)
    assert only_partial == StepFlags(pending_partial=True)


def test_step_flags_refuse_a_carried_grad_naming_carried() -> None:
    with pytest.raises(ValueError, match=r"^carried: InputRole\.GRAD"):
        step_flags(frozenset({InputRole.GRAD}), sync_gradients=True, requires_all_reduce=True)
    with pytest.raises(TypeError, match=r"^carried: expected a frozenset of InputRole"):
        step_flags({InputRole.SHARDED_GRAD}, sync_gradients=True, requires_all_reduce=True)  # type: ignore[arg-type]  # bad input on purpose
    with pytest.raises(TypeError, match=r"^carried"):
        step_flags(frozenset({"sharded_grad"}), sync_gradients=True, requires_all_reduce=True)  # type: ignore[arg-type]  # bad input on purpose
