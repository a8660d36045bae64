"""``model_memory`` and the optimizer's bytes: a whole model's memory per rank, hand-worked
(pure: no process group, no tensor). That the figures equal what a rank really holds, to the
byte, is checked on gloo worlds in ``tests/worlds/test_predict_gloo.py``; the optimizer formulas here
also against torch's own optimizers measured by ``LiveBytes``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from fsdp_core import (
    Division,
    DivisionPolicy,
    Event,
    FlatParamLayout,
    HookEvent,
    MixedPrecision,
    PerParamLayout,
    PerUnitGathers,
    PlanRequest,
    ShardingSpec,
    ShardingStrategy,
)
from fsdp_core.memory import (
    CUDA_CACHING,
    ActivationTrace,
    Allocator,
    Category,
    Executor,
    Mark,
    ModelMemoryRequest,
    OptimizedTensor,
    OptimizerKind,
    OptimizerSpec,
    Phase,
    TracePoint,
    UnitSpec,
    Workspaces,
    cuda_workspaces,
    for_rank,
    model_memory,
    optimized_tensors,
    optimizer_state_bytes,
    optimizer_step_bytes,
)
from fsdp_core.unshard.schedule import UnshardRequest
from fsdp_shell.memory import LiveBytes

F32 = torch.float32


def _unit(numel: int, name: str, *, orig: bool = False, shapes: tuple[int, ...] = ()) -> UnitSpec:
    params = [(f"{name}.p{i}", (n,)) for i, n in enumerate(shapes)] if shapes else [(f"{name}.w", (numel,))]
    layout = FlatParamLayout.of(params, F32, align=orig)
    sharding = ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 2)
    return UnitSpec(request=PlanRequest(layout=layout, sharding=sharding, use_orig_params=orig), name=name)


def _point(at: HookEvent | Mark, live: int, peak: int, taken: int = 0) -> TracePoint:
    return TracePoint(at=at, live=live, peak=peak, taken=taken)


def _hook(event: Event, unit: int) -> HookEvent:
    return HookEvent(event, unit)


TRACE = ActivationTrace(
    points=(
        _point(Mark.FORWARD_START, 0, 64),  # the batch: 64 B
        _point(_hook(Event.PRE_FORWARD, 1), 64, 64),  # the root (unit 1) wraps unit 0
        _point(_hook(Event.PRE_FORWARD, 0), 64, 300),
        _point(_hook(Event.POST_FORWARD, 0), 264, 264),  # unit 0 saved 200 B
        _point(_hook(Event.END_FORWARD, -1), 264, 300),
        _point(_hook(Event.POST_FORWARD, 1), 300, 300),
        _point(Mark.BACKWARD_START, 300, 300),
        _point(_hook(Event.PRE_BACKWARD, 1), 304, 420),  # the root's backward makes its gradient (120 B)
        _point(_hook(Event.POST_BACKWARD, 1), 420, 300, taken=120),
        _point(_hook(Event.PRE_BACKWARD, 0), 300, 500),  # unit 0's gradient: 400 B
        _point(_hook(Event.POST_BACKWARD, 0), 500, 100, taken=400),
        _point(_hook(Event.END_BACKWARD, -1), 4, 4),
        _point(Mark.BACKWARD_END, 4, 4),
        _point(Mark.STEP_END, 0, 0),
    )
)
"""Unit 0: 100 fp32 elements (400 B unsharded, a 200 B shard); the root: 30 (120 B, 60 B)."""


def _request(optimizer: OptimizerKind, **kwargs: object) -> ModelMemoryRequest:
    return ModelMemoryRequest(
        units=(_unit(100, "block"), _unit(30, "")),
        root=1,
        trace=TRACE,
        optimizer=OptimizerSpec(kind=optimizer),
        executor=Executor.STREAMS,
        **kwargs,  # type: ignore[arg-type]  # the test's keyword arguments of ModelMemoryRequest
    )


def test_two_units_on_device_streams_with_sgd_hand_worked() -> None:
    """FSDP's side starts each step at the shards, 260 B. Forward: the root's gather (120 B), unit
    0's (400 B) while it computes up to 300 B: 1080 B. Backward: the root's pre-backward
    prefetches unit 0 (BACKWARD_PRE); the root's plan frees its unsharded parameter and gradient
    and keeps a 60 B shard; unit 0's backward runs up to 500 B over 260 + 400 + 60: 1220 B. The
    optimizer steps on the two reduced shards (260 B)."""
    m = model_memory(_request(OptimizerKind.SGD))
    forward, backward, optimizer = m.peaks
    assert (forward.phase, forward.bytes, forward.at) == (Phase.FORWARD, 1080, _hook(Event.PRE_FORWARD, 0))
    assert forward.breakdown[Category.PARAMS_UNSHARDED] == 520
    assert forward.breakdown[Category.AUTOGRAD] == 300
    assert (backward.phase, backward.bytes, backward.at) == (Phase.BACKWARD, 1220, _hook(Event.PRE_BACKWARD, 0))
    assert backward.breakdown[Category.GRADS_CARRIED] == 60
    assert backward.breakdown[Category.PARAMS_UNSHARDED] == 400
    assert (optimizer.phase, optimizer.bytes) == (Phase.OPTIMIZER, 520)
    assert optimizer.breakdown[Category.GRADS_CARRIED] == 260
    assert sum(m.after_step.values()) == 260
    assert m.after_step[Category.REDUCE] == 0
    assert m.peak is backward


def test_adamw_adds_its_state_everywhere_and_its_temporaries_in_the_step() -> None:
    """AdamW's state: two fp32 copies of each shard (2 x 200 + 2 x 60 B), its step counters on
    the host; one step holds sqrt(exp_avg_sq) / bias_correction of the 200 B shard twice."""
    m = model_memory(_request(OptimizerKind.ADAMW))
    assert [p.bytes for p in m.peaks] == [1080 + 520, 1220 + 520, 520 + 520 + 400]
    assert m.phase_peak(Phase.OPTIMIZER).breakdown[Category.OPTIMIZER_STEP] == 400
    assert sum(m.after_step.values()) == 260 + 520


def test_the_math_libraries_workspace_is_in_every_phase() -> None:
    """``workspace`` bytes (cuBLAS's, once a step has run) add to every phase and to what stays."""
    m = model_memory(_request(OptimizerKind.SGD, workspace=1000))
    assert [p.bytes for p in m.peaks] == [1080 + 1000, 1220 + 1000, 520 + 1000]
    assert all(p.breakdown[Category.WORKSPACE] == 1000 for p in m.peaks)
    assert sum(m.after_step.values()) == 260 + 1000
    with pytest.raises(ValueError, match="workspace: expected an int >= 0"):
        _request(OptimizerKind.SGD, workspace=-1)


MIB = 2**20


@pytest.mark.parametrize(
    ("capability", "env", "cublas", "cublaslt"),
    [
        ((9, 0), {}, 32 * MIB, MIB),  # H100, H200: what an H200 with torch 2.11 allocated
        ((8, 0), {}, 8 * MIB + 128 * 1024, MIB),  # A100: 4096 KiB x 2 + 16 KiB x 8
        ((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 32 * MIB, MIB),
        ((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "0"}, 128 * 1024, 0),
        ((8, 6), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}, 8 * MIB + 128 * 1024, MIB),
    ],
)
def test_cuda_workspaces_are_torchs_defaults_or_the_environments(
    capability: tuple[int, int], env: dict[str, str], cublas: int, cublaslt: int
) -> None:
    got = cuda_workspaces(capability, env)
    assert got == Workspaces(cublas=cublas, cublaslt=cublaslt)
    assert got.bytes == 2 * cublas + cublaslt


def test_malformed_workspace_variables_are_named() -> None:
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG"):
        cuda_workspaces((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "4096"})
    with pytest.raises(ValueError, match="CUBLASLT_WORKSPACE_SIZE"):
        cuda_workspaces((9, 0), {"CUBLASLT_WORKSPACE_SIZE": "1 MiB"})
    with pytest.raises(ValueError, match="threads"):
        Workspaces(cublas=1, cublaslt=1, threads=-1)


def test_ranks_differ_by_their_padding() -> None:
    """101 elements in 2 shards of 51: rank 1's holds one padding element, so with
    use_orig_params its view (and its optimizer state) is one element smaller."""
    units = (_unit(101, "block", orig=True), _unit(30, "", orig=True))
    states = [
        optimizer_state_bytes(
            OptimizerSpec(kind=OptimizerKind.ADAM), optimized_tensors(for_rank(units, r)), host_is_device=False
        )
        for r in (0, 1)
    ]
    assert states == [2 * 4 * (51 + 15), 2 * 4 * (50 + 15)]


def test_a_user_given_trace_chains_the_units() -> None:
    """``ActivationTrace.chain``: each unit's saved bytes from its forward to its post-backward,
    its gradient taken there; the root's forward around the others."""
    request = UnshardRequest.chain(2, reshard_after_forward=True, plan_reshards=True)
    trace = ActivationTrace.chain(request, saved=[30, 200], grads=[120, 400], inputs=64)
    assert trace.forward_order == (0, 1)
    assert trace.backward_order == (0, 1)
    assert trace.post_backward_order == (1, 0)
    taken = {p.at: (p.live, p.taken) for p in trace.points if p.taken}
    assert taken == {
        _hook(Event.POST_BACKWARD, 1): (64 + 230 + 400, 400),
        _hook(Event.POST_BACKWARD, 0): (64 + 30 + 120, 120),
    }
    frozen = ActivationTrace.chain(request, saved=[30, 200], grads=[120, 0], inputs=64)
    assert frozen.post_backward_order == (0,)
    assert next(p for p in frozen.points if p.at is Mark.BACKWARD_END).live == 64, "every activation freed"


def test_bad_input_fails_where_it_is_made() -> None:
    with pytest.raises(ValueError, match="marks forward_start"):
        ActivationTrace(points=(_point(Mark.BACKWARD_START, 0, 0),))
    with pytest.raises(ValueError, match="taken"):
        _point(_hook(Event.POST_BACKWARD, 0), 10, 10, taken=11)
    with pytest.raises(ValueError, match="only a post-backward"):
        _point(_hook(Event.PRE_BACKWARD, 0), 10, 10, taken=1)
    with pytest.raises(ValueError, match="same sharding and rank"):
        ModelMemoryRequest(units=(_unit(100, "a"), for_rank([_unit(30, "")], 1)[0]), root=1, trace=TRACE)
    with pytest.raises(ValueError, match="no parameters here"):
        ModelMemoryRequest(units=(None, _unit(30, "")), root=1, trace=TRACE)
    with pytest.raises(ValueError, match="accumulate"):
        _request(OptimizerKind.SGD, accumulate=0)
    with pytest.raises(ValueError, match="block"):
        Allocator(0)
    with pytest.raises(ValueError, match="optimizer: unknown optimizer 'lion'"):
        OptimizerKind.parse("lion")


def test_cuda_blocks_round_every_tensor_up_to_512_bytes() -> None:
    assert [CUDA_CACHING.size(n) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]
    tensors = [OptimizedTensor(numel=n, dtype=F32, grad_dtype=F32) for n in (1000, 37, 0, 4096)]
    adam = OptimizerSpec(kind=OptimizerKind.ADAM)
    assert optimizer_state_bytes(adam, tensors, host_is_device=False, allocator=CUDA_CACHING) == 2 * (
        4096 + 512 + 0 + 16384
    )


# -- the formulas against torch's optimizers ---------------------------------------------------

NUMELS = (1000, 37, 0, 4096, 300)


@pytest.mark.parametrize("kind", list(OptimizerKind))
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_bytes_are_torchs(kind: OptimizerKind, foreach: bool, dtype: torch.dtype) -> None:
    """What torch's optimizers (default arguments) hold on the CPU, measured: the state made by the
    first step, and the most a later step holds above it."""
    tensors = [OptimizedTensor(numel=n, dtype=dtype, grad_dtype=dtype) for n in NUMELS]
    spec = OptimizerSpec(kind=kind, foreach=foreach)
    with LiveBytes() as live:
        params = [nn.Parameter(torch.randn(n, dtype=dtype)) for n in NUMELS]
        for p in params:
            p.grad = torch.randn(p.numel(), dtype=dtype)
        opt = _optimizer(kind, params, foreach)
        with live.window() as first:
            opt.step()
        with live.window() as later:
            opt.step()
    assert first.end - first.start == optimizer_state_bytes(spec, tensors, host_is_device=True)
    assert later.peak - later.start == optimizer_step_bytes(spec, tensors)


def _optimizer(kind: OptimizerKind, params: list[nn.Parameter], foreach: bool) -> torch.optim.Optimizer:
    match kind:
        case OptimizerKind.SGD:
            return torch.optim.SGD(params, lr=0.1, foreach=foreach)
        case OptimizerKind.SGD_MOMENTUM:
            return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach)
        case OptimizerKind.ADAM:
            return torch.optim.Adam(params, lr=0.1, foreach=foreach)
        case OptimizerKind.ADAMW:
            return torch.optim.AdamW(params, lr=0.1, foreach=foreach)


def test_flops_go_to_the_unit_that_runs_them() -> None:
    """Forward: to the innermost unit between its pre- and post-forward hooks (the root outside
    them); backward: to the unit whose pre-backward fired and whose post-backward has not."""
    flops = {
        Mark.FORWARD_START: 1,
        _hook(Event.PRE_FORWARD, 1): 2,
        _hook(Event.PRE_FORWARD, 0): 30,
        _hook(Event.POST_FORWARD, 0): 4,
        _hook(Event.PRE_BACKWARD, 1): 50,
        _hook(Event.POST_BACKWARD, 1): 6,
        _hook(Event.PRE_BACKWARD, 0): 700,
        _hook(Event.POST_BACKWARD, 0): 8,
    }
    trace = ActivationTrace(points=tuple(dataclasses.replace(p, flops=flops.get(p.at, 0)) for p in TRACE.points))
    assert trace.unit_flops(2, root=1) == ((30, 700), (1 + 2 + 4, 50 + 6 + 8))


def _per_param_unit(shapes: list[tuple[int, ...]], name: str, *, frozen: frozenset[int] = frozenset()) -> UnitSpec:
    """A ``fully_shard`` unit of fp32 parameters over 2 ranks, those in ``frozen`` without gradients."""
    gathered = PerParamLayout.of([(f"{name}.p{i}", s) for i, s in enumerate(shapes)], F32, 2)
    reduce = PerParamLayout(
        params=tuple(p for i, p in enumerate(gathered.params) if i not in frozen), dtype=F32, world=2
    )
    sharding = ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 2)
    request = PlanRequest(layout=reduce, sharding=sharding, division=Division(policy=DivisionPolicy.IN_COLLECTIVE))
    return UnitSpec(request=request, name=name, frozen=frozen, gathered=gathered)


def test_a_fully_shard_units_gather_holds_its_buffer_and_its_parameters_at_once() -> None:
    """The trace above with ``fully_shard`` units of the same sizes (unit 0: 100 fp32 elements, the
    root 30; the root keeps its parameters from forward to backward, unit 0 reshards). FSDP's
    side starts at the padded shards (200 + 60 B). The root's gather: its all-gather buffer
    (120 B) and its unsharded parameter (120 B) both live while the copy-out runs, then the
    buffer goes. Unit 0's: 400 + 400 B over the root's 120 B and the batch (64 B): 260 + 120 +
    400 + 400 + 64 = 1244 B, where a flat parameter, gathered into its own memory, peaks at
    1080 B (``test_two_units_on_device_streams_with_sgd_hand_worked``). Between steps: the
    shards alone (SGD keeps no state)."""
    units = (_per_param_unit([(100,)], "block"), _per_param_unit([(30,)], ""))
    m = model_memory(
        ModelMemoryRequest(
            units=units,
            root=1,
            trace=TRACE,
            optimizer=OptimizerSpec(kind=OptimizerKind.SGD),
            executor=Executor.STREAMS,
            backward_prefetch=None,
            fully_shard=PerUnitGathers(forward_reshards=(True, False)),
        )
    )
    forward = m.phase_peak(Phase.FORWARD)
    assert (forward.bytes, forward.at) == (1244, _hook(Event.PRE_FORWARD, 0))
    assert forward.breakdown[Category.PARAMS_UNSHARDED] == 120 + 400 + 400
    assert forward.breakdown[Category.PARAMS_SHARDED] == 260
    assert sum(m.after_step.values()) == 260


def test_a_fully_shard_unit_knows_its_padded_shards_frozen_parameters_and_restored_gradients() -> None:
    """Shapes (5, 3) and (3,) over 2 ranks: padded shards of 3 x 3 and 2 elements (44 B); the
    frozen second parameter is gathered (all-gather buffer (9 + 2) x 2 x 4 = 88 B) but neither
    reduced nor stepped; the optimizer's tensor is rank 1's unpadded 2 x 3 rows. An fp32 unit
    keeps ``no_sync`` gradients in ``.grad`` (its pending dtype is its compute dtype); one
    computing in bf16 and reducing in fp32 does not."""
    unit = _per_param_unit([(5, 3), (3,)], "u", frozen=frozenset({1}))
    assert unit.sharded_bytes() == (9 + 2) * 4
    assert unit.gather().buffer == 88
    assert unit.trainable and unit.num_params == 2
    rank1 = for_rank([unit], 1)[0]
    assert rank1 is not None
    assert optimized_tensors([rank1], [(0, 0), (0, 1)]) == (OptimizedTensor(numel=6, dtype=F32, grad_dtype=F32),)
    assert unit.request.restores_pending
    bf16 = dataclasses.replace(
        unit.request, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    assert not bf16.restores_pending
    with pytest.raises(ValueError, match="gathered: its parameters but the frozen ones"):
        UnitSpec(request=unit.request, gathered=unit.gathered)
    with pytest.raises(ValueError, match="gathered: a per-parameter unit needs"):
        UnitSpec(request=unit.request)
    with pytest.raises(ValueError, match="fully_shard: expected PerUnitGathers with one forward_reshards bool"):
        ModelMemoryRequest(units=(unit,), root=0, trace=TRACE_ONE_UNIT)
    with pytest.raises(ValueError, match="not both"):
        ModelMemoryRequest(
            units=(unit, _unit(30, "")), root=1, trace=TRACE, fully_shard=PerUnitGathers(forward_reshards=(True, False))
        )


TRACE_ONE_UNIT = ActivationTrace(
    points=(
        _point(Mark.FORWARD_START, 0, 0),
        _point(_hook(Event.PRE_FORWARD, 0), 0, 0),
        _point(_hook(Event.END_FORWARD, -1), 0, 0),
        _point(_hook(Event.POST_FORWARD, 0), 0, 0),
        _point(Mark.BACKWARD_START, 0, 0),
        _point(Mark.BACKWARD_END, 0, 0),
        _point(Mark.STEP_END, 0, 0),
    )
)
