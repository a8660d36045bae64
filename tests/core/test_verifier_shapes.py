"""The verifier catches every class of dtype, numel and device mismatch between an op's buffers,
and between a buffer and the op that produced it.

Each test takes a sound plan (built by the planner, or written out op by op, from
``verifier_cases``) and breaks it in one specific way: an op dropped, two ops swapped, one op
replaced. It then asserts that ``check_plan`` reports the ``Rule`` for that class of bug.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp_core import (
    Accumulate,
    Buffer,
    Cast,
    Destination,
    Device,
    Divide,
    EndOfBackwardWait,
    Free,
    FreeUnshardedParam,
    Group,
    HandOff,
    Input,
    InputRole,
    MixedPrecision,
    Op,
    Pad,
    RecordStream,
    ReduceKind,
    ReduceOpSpec,
    ReduceScatter,
    Rule,
    StepFlags,
    Stream,
    WaitStream,
)
from tests.core.verifier_cases import (
    FULL,
    NCCL_AVG,
    find,
    found,
    is_buffer,
    make_plan,
    op_at,
    replace_at,
    rules,
    substitute,
    with_ops,
)

# -- dtypes, numels, devices ---------------------------------------------------------------


def test_dtype_mismatch_reduce_scatter() -> None:
    """Rule DTYPE_MISMATCH: the reduce-scatter writes a bf16 shard from an fp32 input."""
    plan = make_plan(FULL)
    rs = find(plan, ReduceScatter)
    op = op_at(plan, rs, ReduceScatter)
    bad = dataclasses.replace(op, dst=dataclasses.replace(op.dst, dtype=torch.bfloat16))
    found(replace_at(plan, rs, bad), Rule.DTYPE_MISMATCH, at=rs, says="differ in dtype")


def test_numel_mismatch_reduce_scatter() -> None:
    """Rule NUMEL_MISMATCH: the reduce-scatter's input is not group size x its output."""
    plan = make_plan(FULL)
    rs = find(plan, ReduceScatter)
    op = op_at(plan, rs, ReduceScatter)
    bad = dataclasses.replace(op, dst=dataclasses.replace(op.dst, numel=op.dst.numel + 1))
    found(replace_at(plan, rs, bad), Rule.NUMEL_MISMATCH, at=rs, says="must be 8 x output")


def test_reduce_scatter_input_smaller_than_flat_parameter() -> None:
    """Rule REDUCTION: a hand-written plan without the Pad reduce-scatters a truncated gradient
    (floor(1001 / 8) * 8 = 1000 elements): the last element would never be reduced."""
    plan = make_plan(FULL, division=NCCL_AVG)
    grad = Buffer(name="grad", numel=1001, dtype=torch.float32)
    truncated = Buffer(name="grad", numel=1000, dtype=torch.float32)
    shard = Buffer(name="shard", numel=125, dtype=torch.float32)
    avg = ReduceOpSpec(kind=ReduceKind.AVG)
    broken = with_ops(
        plan,
        (
            FreeUnshardedParam(stream=Stream.COMPUTE),
            Input(buffer=grad, role=InputRole.GRAD, stream=Stream.COMPUTE),
            WaitStream(stream=Stream.POST_BACKWARD, waits_for=Stream.COMPUTE),
            ReduceScatter(src=truncated, dst=shard, group=Group.SHARD, reduce_op=avg, stream=Stream.POST_BACKWARD),
            RecordStream(buffer=grad, stream=Stream.POST_BACKWARD),
            Free(buffer=grad, stream=Stream.COMPUTE),
            EndOfBackwardWait(stream=Stream.COMPUTE, waits_for=Stream.POST_BACKWARD),
            HandOff(buffer=shard, destination=Destination.SHARDED_GRAD, stream=Stream.COMPUTE),
        ),
    )
    found(broken, Rule.REDUCTION, at=3, says="smaller than the flat parameter (1001)")


def test_numel_mismatch_pad_shrinks() -> None:
    """Rule NUMEL_MISMATCH: a Pad whose output is smaller than its input."""
    plan = make_plan(FULL)
    pad = find(plan, Pad)
    op = op_at(plan, pad, Pad)
    bad = dataclasses.replace(op, dst=dataclasses.replace(op.dst, numel=1000))
    found(replace_at(plan, pad, bad), Rule.NUMEL_MISMATCH, at=pad, says="pad shrinks")


def test_dtype_mismatch_accumulate() -> None:
    """Rule DTYPE_MISMATCH: accumulating a bf16 shard into the fp32 sharded gradient (the cast
    back is missing)."""
    plan = make_plan(FULL, mp=MixedPrecision(param_dtype=torch.bfloat16), flags=StepFlags(accumulate=True))
    cast = find(plan, Cast, lambda op: op.dst.name == "shard.fp32")
    cast_op = op_at(plan, cast, Cast)
    acc = find(plan, Accumulate)
    acc_op = op_at(plan, acc, Accumulate)
    edited: list[Op] = []
    for i, op in enumerate(plan.ops):
        if i == cast or (isinstance(op, Free) and op.buffer.name == cast_op.src.name):
            continue
        if i == acc:
            edited.append(dataclasses.replace(acc_op, src=cast_op.src))
        elif isinstance(op, Free) and op.buffer == cast_op.dst:
            edited.append(dataclasses.replace(op, buffer=cast_op.src))
        else:
            edited.append(op)
    broken = with_ops(plan, edited)
    found(broken, Rule.DTYPE_MISMATCH, says="accumulate shard[126:bfloat16] into sharded_grad[126:float32]")


def test_device_mismatch_cast_to_host() -> None:
    """Rule DEVICE_MISMATCH: a Cast silently moves the shard to host memory."""
    plan = make_plan(FULL, mp=MixedPrecision(param_dtype=torch.float16))
    cast = find(plan, Cast, lambda op: op.dst.name == "shard.fp32")
    op = op_at(plan, cast, Cast)
    bad = dataclasses.replace(op, dst=dataclasses.replace(op.dst, device=Device.HOST))
    found(replace_at(plan, cast, bad), Rule.DEVICE_MISMATCH, at=cast, says="crosses devices outside an offload")


def test_buffer_disagrees_with_its_producer() -> None:
    """Rule DTYPE_MISMATCH: a later op names the shard with another dtype than it was produced in."""
    plan = make_plan(FULL)
    divide = find(plan, Divide, is_buffer("shard"))
    op = op_at(plan, divide, Divide)
    bad = dataclasses.replace(op, buffer=dataclasses.replace(op.buffer, dtype=torch.float16))
    found(replace_at(plan, divide, bad), Rule.DTYPE_MISMATCH, at=divide, says="disagrees with how it was produced")


# -- gaps found while writing these tests, since closed ---------------------------------------------------


@pytest.mark.parametrize("change", ["numel", "dtype"])
def test_gradient_input_disagrees_with_layout(change: str) -> None:
    """Rule NUMEL_MISMATCH / DTYPE_MISMATCH: the plan declares the autograd gradient with 1000
    elements for a 1001-element flat parameter (or in fp16 for an fp32 compute dtype)."""
    plan = make_plan(FULL)
    grad = op_at(plan, find(plan, Input), Input).buffer
    wrong = (
        dataclasses.replace(grad, numel=1000) if change == "numel" else dataclasses.replace(grad, dtype=torch.float16)
    )
    edited = [substitute(op, grad, wrong) for op in plan.ops]
    if change == "dtype":
        pad = next(i for i, op in enumerate(edited) if isinstance(op, Pad))
        pad_op = edited[pad]
        assert isinstance(pad_op, Pad)
        fp32 = Buffer(name="grad.fp32", numel=grad.numel, dtype=torch.float32)
        edited[pad : pad + 1] = [
            Cast(src=wrong, dst=fp32, stream=Stream.POST_BACKWARD),
            dataclasses.replace(pad_op, src=fp32),
            Free(buffer=fp32, stream=Stream.POST_BACKWARD),
        ]
    broken = with_ops(plan, edited)
    expected = Rule.NUMEL_MISMATCH if change == "numel" else Rule.DTYPE_MISMATCH
    assert expected in rules(broken)
