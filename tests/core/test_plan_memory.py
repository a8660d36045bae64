"""``plan_memory``: a plan's bytes op by op, hand-worked (pure, no process group).

Every figure is bytes allocated minus bytes returned since the plan started; the new gradient
and the unsharded parameter are live before it, so what the plan frees of them counts negative.
That they equal what the CPU runtime really holds, to the byte, is checked against
``LiveBytes`` in ``tests/worlds/test_memory_gloo.py``.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from fsdp_core import (
    PLANS_IN_FLIGHT,
    CPUOffload,
    FlatParamLayout,
    MixedPrecision,
    ShardingSpec,
    ShardingStrategy,
    check_plan,
    plan_post_backward,
)
from fsdp_core.memory import Executor, backward_footprints, plan_memory, unsharded_param_bytes
from fsdp_core.plan.ops import Free


def _layout(numel: int) -> FlatParamLayout:
    return FlatParamLayout.of([("w", (numel,))], torch.float32)


def test_hybrid_bf16_compute_fp32_reduce_on_the_cpu_lane() -> None:
    """4160 elements, 2 shards x 2 replicas: the bf16 gradient (8320 B) is cast to fp32
    (16640 B), reduce-scattered into an fp32 shard (8320 B) through a receive buffer the size of
    its input (16640 B) and all-reduced on the lane; the bf16 unsharded parameter (8320 B) goes
    first."""
    plan = plan_post_backward(
        _layout(4160),
        ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 4, 2),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    m = plan_memory(plan, Executor.CPU_LANE)
    assert unsharded_param_bytes(plan.request) == 8320
    assert (m.inputs, m.unsharded, m.handed_off) == (8320, 8320, 8320)
    #           reshard input  wait   cast  record free  div   rs    free   wait..divide    eob x2      hand
    assert m.after == (
        -8320,
        -8320,
        -8320,
        8320,
        8320,
        0,
        0,
        8320,
        -8320,
        -8320,
        -8320,
        -8320,
        -8320,
        -8320,
        -8320,
        -8320,
    )
    assert (m.peak, m.peak_op) == (24960, 7), "the receive buffer on top of the shard and the fp32 gradient"
    assert (m.after_hook, m.returned_later, m.end) == (-8320, 0, -8320)


def test_on_device_streams_no_receive_buffer_and_the_first_peak_counts() -> None:
    plan = plan_post_backward(
        _layout(4160),
        ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 4, 2),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    m = plan_memory(plan, Executor.STREAMS)
    assert (m.peak, m.peak_op) == (8320, 3)
    assert m.end == -8320


def test_a_buffer_the_lane_still_uses_is_returned_at_the_next_wait() -> None:
    """bf16 reduction of fp32 parameters: the bf16 shard (1000 B) is all-reduced and cast to
    fp32 (2000 B) on the lane; its free in the hook is returned only at the end of backward."""
    plan = plan_post_backward(
        _layout(1000),
        ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 4, 2),
        mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16),
    )
    m = plan_memory(plan, Executor.CPU_LANE)
    assert (m.inputs, m.unsharded, m.handed_off) == (4000, 4000, 2000)
    assert (m.peak, m.peak_op) == (0, -1), "it frees the unsharded parameter before it allocates"
    assert (m.after_hook, m.returned_later) == (-5000, 1000)
    assert m.end == -6000
    streams = plan_memory(plan, Executor.STREAMS)
    assert (streams.after_hook, streams.returned_later, streams.end) == (-6000, 0, -6000)


def test_offload_on_the_cpu_copies_nothing_and_on_a_device_frees_the_shard() -> None:
    """FULL_SHARD over 2, 1000 fp32 elements, offloaded: on the CPU the host buffer is the
    shard itself (2000 B handed off); on a device the shard is freed and the host buffer is
    host memory."""
    plan = plan_post_backward(
        _layout(1000), ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 2), offload=CPUOffload(offload_params=True)
    )
    cpu = plan_memory(plan, Executor.CPU_LANE)
    assert (cpu.peak, cpu.peak_op) == (2000, 4), "shard 2000 + receive buffer 4000 - unsharded 4000"
    assert (cpu.end, cpu.handed_off) == (-6000, 2000)
    device = plan_memory(plan, Executor.STREAMS)
    assert (device.peak, device.peak_op) == (0, -1)
    assert (device.end, device.handed_off) == (-8000, 0)


def test_no_shard_keeps_its_parameter_and_frees_nothing_of_it() -> None:
    plan = plan_post_backward(_layout(1000), ShardingSpec.for_world(ShardingStrategy.NO_SHARD, 2))
    assert unsharded_param_bytes(plan.request) == 0
    m = plan_memory(plan, Executor.CPU_LANE)
    assert (m.unsharded, m.inputs, m.handed_off) == (0, 4000, 4000)
    assert m.end == 0, "the all-reduced gradient is the one handed off"


def test_holding_each_fp32_reduce_output_to_the_end_of_backward_grows_with_the_units() -> None:
    """PyTorch PR 179129's leak as a plan: bf16 parameters reduced in fp32 over HSDP, each
    unit's fp32 reduce-scatter output (2000 B here) freed only at the end of backward instead of
    after its cast back. The verifier accepts it (it is sound, only wasteful); the memory
    prediction shows what it costs: one more fp32 shard per unit held through the backward."""
    plan = plan_post_backward(
        FlatParamLayout.of([("w", (1000,))], torch.bfloat16),
        ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 4, 2),
        mixed_precision=MixedPrecision(reduce_dtype=torch.float32),
    )
    free = next(i for i, op in enumerate(plan.ops) if isinstance(op, Free) and op.buffer.name == "shard")
    ops = list(plan.ops)
    held = ops.pop(free)
    leaky = dataclasses.replace(plan, ops=(*ops[:-1], held, ops[-1]))
    assert check_plan(leaky) == []
    units = 8
    for executor, kept in ((Executor.STREAMS, 0), (Executor.CPU_LANE, PLANS_IN_FLIGHT + 1)):
        good = backward_footprints([plan] * units, executor)
        bad = backward_footprints([leaky] * units, executor)
        held_good = list(itertools.accumulate(f.net for f in good))
        held_bad = list(itertools.accumulate(f.net for f in bad))
        # on the CPU lane the good plan's shard, still read by the lane, is returned only
        # PLANS_IN_FLIGHT plans later: that many (and this one) are held either way
        extra = [2000 * max(0, k + 1 - kept) for k in range(units)]
        assert [b - g for b, g in zip(held_bad, held_good)] == extra, executor


def test_a_per_parameter_unit_gathers_into_a_buffer_of_its_own_then_copies_out() -> None:
    """9 x 6 and 9 rows over 4 ranks (chunks of 3 rows: stacked 72 and 12 elements) and 4 x 8 on
    dimension 1 (chunks of 2 columns: stacked 32, and its whole 32), in bf16: a buffer of 116
    elements from the issue, the unsharded memory (116 stacked + 32 whole) where the gather is
    awaited, with the concatenation of the 4 x 8 parameter's chunks (32) on top, then the buffer
    back."""
    from fsdp_core import PerParamLayout
    from fsdp_core.memory import GatherWalk, per_param_gather_bytes
    from fsdp_core.unshard.schedule import AwaitGather, Gather, Reshard

    layout = PerParamLayout.of([("w", (9, 6)), ("b", (9,)), ("v", (4, 8), 1)], torch.float32, 4)
    gb = per_param_gather_bytes(layout, torch.bfloat16)
    assert (gb.buffer, gb.unsharded, gb.copy_out) == (232, 296, 64)
    walk = GatherWalk([gb])
    assert walk.run_all([Gather(unit=0)]) == (232, 232)
    assert walk.run_all([AwaitGather(unit=0)]) == (296 + 64, 296 - 232)
    assert walk.run_all([Reshard(unit=0)]) == (0, -296)
    assert walk.run_all([Gather(unit=0)]) == (232, 232)
    walk.resharded(0)  # an all-gather no one waited for: only its buffer comes back
    assert walk.live == 0
