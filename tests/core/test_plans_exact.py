"""Exact plans for named situations, every op written out by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp_core import (
    Accumulate,
    AllReduce,
    Buffer,
    Cast,
    CommHook,
    CommHookCall,
    CPUOffload,
    Destination,
    Device,
    Divide,
    EndOfBackwardWait,
    Free,
    FreeUnshardedParam,
    GradViews,
    Group,
    HandOff,
    HybridAllReduce,
    Input,
    InputRole,
    MixedPrecision,
    Offload,
    Pad,
    PlanCache,
    PlanRequest,
    RecordStream,
    ReduceKind,
    ReduceOpSpec,
    ReduceScatter,
    ShardingSpec,
    ShardingStrategy,
    ShardView,
    StepFlags,
    Stream,
    WaitStream,
    check_plan,
    comm_volume,
    plan_post_backward,
)
from fsdp_core.spec.layout import FlatParamLayout

F32, BF16 = torch.float32, torch.bfloat16
C, PB, AR = Stream.COMPUTE, Stream.POST_BACKWARD, Stream.ALL_REDUCE
SUM = ReduceOpSpec()


def buf(name: str, numel: int, dtype: torch.dtype = F32, device: Device = Device.DEVICE) -> Buffer:
    return Buffer(name=name, numel=numel, dtype=dtype, device=device)


def one_param(numel: int) -> FlatParamLayout:
    return FlatParamLayout.of([("w", (numel,))], F32)


def test_full_shard_world_8_1001_elements() -> None:
    plan = plan_post_backward(one_param(1001), ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 8))
    grad, padded, shard = buf("grad", 1001), buf("grad.padded", 1008), buf("shard", 126)
    assert plan.ops == (
        FreeUnshardedParam(stream=C),
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        WaitStream(stream=PB, waits_for=C),
        Pad(src=grad, dst=padded, stream=PB),
        RecordStream(buffer=grad, stream=PB),
        Free(buffer=grad, stream=C),
        Divide(buffer=padded, factor=4.0, stream=PB),
        ReduceScatter(src=padded, dst=shard, group=Group.SHARD, reduce_op=SUM, stream=PB),
        Free(buffer=padded, stream=PB),
        Divide(buffer=shard, factor=2.0, stream=PB),
        EndOfBackwardWait(stream=C, waits_for=PB),
        HandOff(buffer=shard, destination=Destination.SHARDED_GRAD, stream=C),
    )
    assert check_plan(plan) == []
    (rs,) = comm_volume(plan)
    assert (rs.input_numel, rs.output_numel, rs.bytes) == (1008, 126, 7 * 126 * 4)
    assert (plan.consumed, plan.carried_out) == (frozenset(), InputRole.SHARDED_GRAD)
    assert dataclasses.replace(plan, ops=plan.ops[:-1]).carried_out is None


def test_hybrid_shard_32_as_4_by_8_all_reduces_126_on_the_all_reduce_stream() -> None:
    sharding = ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 32, 8)
    assert (sharding.shard_size, sharding.replicate_size) == (8, 4)
    plan = plan_post_backward(one_param(1001), sharding)
    grad, padded, shard = buf("grad", 1001), buf("grad.padded", 1008), buf("shard", 126)
    assert plan.ops == (
        FreeUnshardedParam(stream=C),
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        WaitStream(stream=PB, waits_for=C),
        Pad(src=grad, dst=padded, stream=PB),
        RecordStream(buffer=grad, stream=PB),
        Free(buffer=grad, stream=C),
        Divide(buffer=padded, factor=8.0, stream=PB),
        ReduceScatter(src=padded, dst=shard, group=Group.SHARD, reduce_op=SUM, stream=PB),
        Free(buffer=padded, stream=PB),
        WaitStream(stream=AR, waits_for=PB),
        RecordStream(buffer=shard, stream=AR),
        AllReduce(buffer=shard, group=Group.REPLICATE, reduce_op=SUM, stream=AR),
        Divide(buffer=shard, factor=4.0, stream=AR),
        EndOfBackwardWait(stream=C, waits_for=PB),
        EndOfBackwardWait(stream=C, waits_for=AR),
        HandOff(buffer=shard, destination=Destination.SHARDED_GRAD, stream=C),
    )
    assert check_plan(plan) == []
    _rs, ar = comm_volume(plan)
    assert (ar.collective, ar.group, ar.group_size, ar.input_numel) == ("all_reduce", Group.REPLICATE, 4, 126)
    assert ar.bytes == 2 * 3 * 32 * 4  # ceil(126 / 4) = 32-element chunks


def test_sync_hybrid_all_reduce_follows_the_reduce_scatter_on_the_post_backward_stream() -> None:
    """FSDP1 before PyTorch PR 106080: the same ops, but the all-reduce stays on post_backward
    (so the next unit's reduce-scatter queues behind it) and only that stream is waited for."""
    sharding = ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 32, 8)
    plan = plan_post_backward(one_param(1001), sharding, hybrid_all_reduce=HybridAllReduce.SYNC)
    grad, padded, shard = buf("grad", 1001), buf("grad.padded", 1008), buf("shard", 126)
    assert plan.ops == (
        FreeUnshardedParam(stream=C),
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        WaitStream(stream=PB, waits_for=C),
        Pad(src=grad, dst=padded, stream=PB),
        RecordStream(buffer=grad, stream=PB),
        Free(buffer=grad, stream=C),
        Divide(buffer=padded, factor=8.0, stream=PB),
        ReduceScatter(src=padded, dst=shard, group=Group.SHARD, reduce_op=SUM, stream=PB),
        Free(buffer=padded, stream=PB),
        AllReduce(buffer=shard, group=Group.REPLICATE, reduce_op=SUM, stream=PB),
        Divide(buffer=shard, factor=4.0, stream=PB),
        EndOfBackwardWait(stream=C, waits_for=PB),
        HandOff(buffer=shard, destination=Destination.SHARDED_GRAD, stream=C),
    )
    assert check_plan(plan) == []
    same = [dataclasses.replace(v, op_index=0) for v in comm_volume(plan_post_backward(one_param(1001), sharding))]
    assert [dataclasses.replace(v, op_index=0) for v in comm_volume(plan)] == same
    with pytest.raises(ValueError, match="hybrid_all_reduce: only hybrid strategies"):
        plan_post_backward(
            one_param(8), ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 4), hybrid_all_reduce=HybridAllReduce.SYNC
        )


def test_no_shard_is_one_all_reduce_without_padding() -> None:
    plan = plan_post_backward(one_param(1001), ShardingSpec.for_world(ShardingStrategy.NO_SHARD, 4))
    grad = buf("grad", 1001)
    assert plan.ops == (
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        WaitStream(stream=PB, waits_for=C),
        Divide(buffer=grad, factor=2.0, stream=PB),
        AllReduce(buffer=grad, group=Group.SHARD, reduce_op=SUM, stream=PB),
        Divide(buffer=grad, factor=2.0, stream=PB),
        EndOfBackwardWait(stream=C, waits_for=PB),
        HandOff(buffer=grad, destination=Destination.SHARDED_GRAD, stream=C),
    )
    assert not plan.should_free_in_backward
    assert check_plan(plan) == []


def test_shard_grad_op_no_sync_keeps_the_unsharded_parameter_and_accumulates_locally() -> None:
    sharding = ShardingSpec.for_world(ShardingStrategy.SHARD_GRAD_OP, 2)
    plan = plan_post_backward(one_param(7), sharding, flags=StepFlags(sync_gradients=False, pending_unsharded=True))
    grad, pending = buf("grad", 7), buf("grad.pending", 7)
    assert plan.ops == (
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        Input(buffer=pending, role=InputRole.PENDING_UNSHARDED, stream=C),
        Accumulate(dst=pending, src=grad, stream=C),
        Free(buffer=grad, stream=C),
        HandOff(buffer=pending, destination=Destination.UNSHARDED_GRAD, stream=C),
    )
    assert comm_volume(plan) == ()
    assert check_plan(plan) == []
    assert (plan.consumed, plan.carried_out) == (frozenset({InputRole.PENDING_UNSHARDED}), InputRole.PENDING_UNSHARDED)
    full = plan_post_backward(
        one_param(7), ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 2), flags=StepFlags(sync_gradients=False)
    )
    assert full.ops[0] == FreeUnshardedParam(stream=C)


def test_mixed_precision_offload_accumulate_use_orig_params() -> None:
    layout = FlatParamLayout.of([("a", (3,)), ("b", (2, 3))], F32, align=True, align_dtype=BF16)
    # bf16 alignment is 8 elements: a at 0..3, b starts at 8, total 14.
    assert layout.offsets == (0, 8) and layout.total_numel == 14
    sharding = ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 4, rank=1)
    plan = plan_post_backward(
        layout,
        sharding,
        mixed_precision=MixedPrecision(param_dtype=BF16),
        offload=CPUOffload(offload_params=True),
        use_orig_params=True,
        flags=StepFlags(accumulate=True),
    )
    grad, cpu = buf("grad", 14, BF16), buf("cpu_grad", 4, F32, Device.HOST)
    padded, shard, shard32 = buf("grad.padded", 16, BF16), buf("shard", 4, BF16), buf("shard.fp32", 4, F32)
    # shard = ceil(14 / 4) = 4: rank 1 holds flat elements 4..7, alignment padding only, so no views.
    # dp = 4: FSDP1 divides by 2 before and 2 after; reduce in bf16, cast back to fp32, add on the host.
    assert plan.ops == (
        FreeUnshardedParam(stream=C),
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        Input(buffer=cpu, role=InputRole.SHARDED_GRAD, stream=C),
        WaitStream(stream=PB, waits_for=C),
        Pad(src=grad, dst=padded, stream=PB),
        RecordStream(buffer=grad, stream=PB),
        Free(buffer=grad, stream=C),
        Divide(buffer=padded, factor=2.0, stream=PB),
        ReduceScatter(src=padded, dst=shard, group=Group.SHARD, reduce_op=SUM, stream=PB),
        Free(buffer=padded, stream=PB),
        Divide(buffer=shard, factor=2.0, stream=PB),
        Cast(src=shard, dst=shard32, stream=PB),
        Free(buffer=shard, stream=PB),
        Offload(src=shard32, dst=cpu, accumulate=True, stream=PB),
        Free(buffer=shard32, stream=PB),
        EndOfBackwardWait(stream=C, waits_for=PB),
        GradViews(buffer=cpu, views=(), stream=C),
        HandOff(buffer=cpu, destination=Destination.CPU_GRAD, stream=C),
    )
    assert check_plan(plan) == []
    assert (plan.consumed, plan.carried_out) == (frozenset({InputRole.SHARDED_GRAD}), InputRole.SHARDED_GRAD)
    rank2 = sharding.shard_views(layout, 2)
    assert rank2 == (ShardView(param_index=1, param_name="b", offset_in_buffer=0, offset_in_param=0, numel=4),)


def test_grad_views_are_exposed_at_the_end_of_backward_on_compute() -> None:
    layout = FlatParamLayout.of([("a", (2,)), ("b", (5,))], F32, align=True)
    sharding = ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 4, 2, rank=1)
    plan = plan_post_backward(layout, sharding, use_orig_params=True)
    # a at 0, two fp32 elements of alignment padding (16 bytes), b at 4: 9 elements, padded to 10.
    # Rank 1's shard is flat 5..9: b[1:5] and one zero of padding. dp = 4: divide by 2 and 2.
    grad, padded, shard = buf("grad", 9), buf("grad.padded", 10), buf("shard", 5)
    b_slice = ShardView(param_index=1, param_name="b", offset_in_buffer=0, offset_in_param=1, numel=4)
    end_of_backward = (
        EndOfBackwardWait(stream=C, waits_for=PB),
        EndOfBackwardWait(stream=C, waits_for=AR),
        GradViews(buffer=shard, views=(b_slice,), stream=C),
        HandOff(buffer=shard, destination=Destination.SHARDED_GRAD, stream=C),
    )
    assert plan.ops == (
        FreeUnshardedParam(stream=C),
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        WaitStream(stream=PB, waits_for=C),
        Pad(src=grad, dst=padded, stream=PB),
        RecordStream(buffer=grad, stream=PB),
        Free(buffer=grad, stream=C),
        Divide(buffer=padded, factor=2.0, stream=PB),
        ReduceScatter(src=padded, dst=shard, group=Group.SHARD, reduce_op=SUM, stream=PB),
        Free(buffer=padded, stream=PB),
        WaitStream(stream=AR, waits_for=PB),
        RecordStream(buffer=shard, stream=AR),
        AllReduce(buffer=shard, group=Group.REPLICATE, reduce_op=SUM, stream=AR),
        Divide(buffer=shard, factor=2.0, stream=AR),
        *end_of_backward,
    )
    assert plan.callback_ops == end_of_backward
    assert check_plan(plan) == []


def test_no_sync_grad_views_come_right_before_the_hand_off() -> None:
    layout = FlatParamLayout.of([("a", (2,)), ("b", (5,))], F32, align=True)
    sharding = ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 2)
    plan = plan_post_backward(layout, sharding, use_orig_params=True, flags=StepFlags(sync_gradients=False))
    grad = buf("grad", 9)
    whole = (
        ShardView(param_index=0, param_name="a", offset_in_buffer=0, offset_in_param=0, numel=2),
        ShardView(param_index=1, param_name="b", offset_in_buffer=4, offset_in_param=0, numel=5),
    )
    assert plan.ops == (
        FreeUnshardedParam(stream=C),
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        GradViews(buffer=grad, views=whole, stream=C),
        HandOff(buffer=grad, destination=Destination.UNSHARDED_GRAD, stream=C),
    )
    assert plan.callback_ops == ()
    assert check_plan(plan) == []


def test_hybrid_with_a_comm_hook_then_replicate_all_reduce() -> None:
    sharding = ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD_ZERO2, 4, 2)
    plan = plan_post_backward(one_param(6), sharding, comm_hook=CommHook.FP16_COMPRESS)
    grad, shard = buf("grad", 6), buf("shard", 3)
    hook = CommHookCall(
        hook=CommHook.FP16_COMPRESS,
        src=grad,
        dst=shard,
        group=Group.SHARD,
        divides_by=2,
        wire_dtype=torch.float16,
        stream=PB,
    )
    assert plan.ops == (
        FreeUnshardedParam(stream=C),
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        WaitStream(stream=PB, waits_for=C),
        hook,
        RecordStream(buffer=grad, stream=PB),
        Free(buffer=grad, stream=C),
        WaitStream(stream=AR, waits_for=PB),
        RecordStream(buffer=shard, stream=AR),
        Divide(buffer=shard, factor=2.0, stream=AR),  # FSDP1's split of the replicate size 2: pre 2, post 1
        AllReduce(buffer=shard, group=Group.REPLICATE, reduce_op=SUM, stream=AR),
        EndOfBackwardWait(stream=C, waits_for=PB),
        EndOfBackwardWait(stream=C, waits_for=AR),
        HandOff(buffer=shard, destination=Destination.SHARDED_GRAD, stream=C),
    )
    assert check_plan(plan) == []


def test_hybrid_deferred_all_reduce_keeps_a_partial_then_folds_it_in() -> None:
    sharding = ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 4, 2)
    first = plan_post_backward(one_param(4), sharding, flags=StepFlags(requires_all_reduce=False))
    grad, shard, partial = buf("grad", 4), buf("shard", 2), buf("partial", 2)
    # dp = 4: FSDP1 pre-divides by 2; the post-divide by 2 waits for the deferred all-reduce.
    assert first.ops == (
        FreeUnshardedParam(stream=C),
        Input(buffer=grad, role=InputRole.GRAD, stream=C),
        WaitStream(stream=PB, waits_for=C),
        Divide(buffer=grad, factor=2.0, stream=PB),
        ReduceScatter(src=grad, dst=shard, group=Group.SHARD, reduce_op=SUM, stream=PB),
        RecordStream(buffer=grad, stream=PB),
        Free(buffer=grad, stream=C),
        EndOfBackwardWait(stream=C, waits_for=PB),
        HandOff(buffer=shard, destination=Destination.PARTIAL, stream=C),
    )
    assert first.destination is Destination.PARTIAL
    assert (first.consumed, first.carried_out) == (frozenset(), InputRole.PENDING_PARTIAL)
    assert [v.collective for v in comm_volume(first)] == ["reduce_scatter"]
    last = plan_post_backward(one_param(4), sharding, flags=StepFlags(pending_partial=True))
    assert Input(buffer=partial, role=InputRole.PENDING_PARTIAL, stream=C) in last.ops
    fold = last.ops.index(Accumulate(dst=shard, src=partial, stream=PB))
    all_reduce = next(i for i, op in enumerate(last.ops) if isinstance(op, AllReduce))
    assert fold < all_reduce
    assert (last.consumed, last.carried_out) == (frozenset({InputRole.PENDING_PARTIAL}), InputRole.SHARDED_GRAD)
    assert check_plan(first) == [] and check_plan(last) == []


def test_in_collective_division_uses_avg_on_nccl() -> None:
    from fsdp_core import BackendCaps, Division, DivisionPolicy

    division = Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=BackendCaps.for_backend("nccl"))
    plan = plan_post_backward(
        one_param(8), ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 8, 4), division=division
    )
    avg = ReduceOpSpec(kind=ReduceKind.AVG)
    assert not any(isinstance(op, Divide) for op in plan.ops)
    assert [op.reduce_op for op in plan.ops if isinstance(op, (ReduceScatter, AllReduce))] == [avg, avg]
    assert check_plan(plan) == []


def test_plans_are_values_and_cached() -> None:
    request = PlanRequest(layout=one_param(1001), sharding=ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 8))
    again = PlanRequest(layout=one_param(1001), sharding=ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 8))
    assert request == again and hash(request) == hash(again)
    cache = PlanCache()
    assert cache(request) is cache(again)
    assert hash(cache(request)) == hash(plan_post_backward(one_param(1001), request.sharding))
