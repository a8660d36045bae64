"""Documentation examples, their catalog: every named plan, all-gather schedule, ``fsdp-sim``
output and ``fsdp-plan`` command line a document may show, and how each is built.

A block ``<!-- kind:name -->`` names an entry of one table here (``scripts/gen_doc_examples.py``'s
docstring lists the kinds); ``scripts/doc_examples_render.py`` prints it. Examples are built
through ``fsdp_core``'s public API; the broken variants that docs/verifier.md shows are built by
``scripts/doc_examples_broken.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial

import torch

from fsdp_core import (
    AwaitGather,
    BackendCaps,
    BackwardPrefetch,
    CommHook,
    CPUOffload,
    Device,
    Divide,
    Division,
    DivisionPolicy,
    Event,
    FlatParamLayout,
    FreeUnshardedParam,
    Gather,
    Input,
    MixedPrecision,
    Plan,
    RecordStream,
    Reshard,
    ShardingSpec,
    ShardingStrategy,
    StepFlags,
    UnshardRequest,
    UnshardSchedule,
    WaitStream,
    plan_post_backward,
    plan_unshard,
)
from fsdp_core.sim import SEED_PARAMETERS, SEED_ROWS, format_seed_table, format_seed_timeline, seed_calibration
from scripts.doc_examples_broken import (
    break_dropped_gradient,
    break_hand_off,
    break_leak,
    break_redefined,
    break_reduction,
    break_use_after_free,
    break_views,
    retarget,
    verifier_base,
    with_actions,
    without,
)

S = ShardingStrategy


@dataclass(frozen=True, slots=True, kw_only=True)
class Example:
    """A named configuration: how to build its plan, and how to simulate its timeline."""

    build: Callable[[], Plan]
    units: int = 1
    """Timeline blocks: equal units whose post-backwards run back to back."""
    backward_ms: float = 0.0
    """Timeline blocks: compute-stream backward time before each unit's hook, in ms."""
    unshard: Callable[[], UnshardSchedule] | None = None
    """Timeline blocks: the all-gather schedule whose backward all-gathers run too."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleExample:
    """A named all-gather schedule."""

    build: Callable[[], UnshardSchedule]


# -- configurations ---------------------------------------------------------------------------

W1001 = FlatParamLayout.of([("w", (1001,))], torch.float32)
"""One 1001-element fp32 parameter: 1001 = 7 x 11 x 13, so it divides by no power of two."""

LINEAR = FlatParamLayout.of([("fc.weight", (100, 10)), ("fc.bias", (100,))], torch.float32)
"""``nn.Linear(10, 100)``: 1100 elements, divisible by 4."""

ORIG = FlatParamLayout.of(
    [("fc.weight", (10, 10)), ("fc.bias", (10,)), ("ln.weight", (10,)), ("ln.bias", (10,))],
    torch.float32,
    align=True,
)
"""``Linear(10, 10)`` + ``LayerNorm(10)`` with ``use_orig_params`` alignment (4 fp32 elements)."""

FULL8 = ShardingSpec.for_world(S.FULL_SHARD, 8)
HYBRID32 = ShardingSpec.for_world(S.HYBRID_SHARD, 32, shard_size=8)
NCCL_IN_COLLECTIVE = Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=BackendCaps.for_backend("nccl"))


def _chain(
    units: int = 4,
    prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    *,
    reshard_after_forward: bool = True,
    forward_prefetch: bool = False,
) -> UnshardSchedule:
    return plan_unshard(
        UnshardRequest.chain(
            units,
            reshard_after_forward=reshard_after_forward,
            plan_reshards=True,
            backward_prefetch=prefetch,
            forward_prefetch=forward_prefetch,
        )
    )


_E = Event


def _g(unit: int) -> Gather:
    return Gather(unit=unit)


def _a(unit: int) -> AwaitGather:
    return AwaitGather(unit=unit)


def _r(unit: int) -> Reshard:
    return Reshard(unit=unit)


EXAMPLES: Mapping[str, Example] = {
    # docs/examples.md: one per strategy
    "no_shard": Example(build=lambda: plan_post_backward(W1001, ShardingSpec.for_world(S.NO_SHARD, 8))),
    "full_shard": Example(build=lambda: plan_post_backward(W1001, FULL8)),
    "shard_grad_op": Example(build=lambda: plan_post_backward(LINEAR, ShardingSpec.for_world(S.SHARD_GRAD_OP, 4))),
    "hybrid_shard": Example(build=lambda: plan_post_backward(W1001, HYBRID32)),
    "hybrid_shard_zero2": Example(
        build=lambda: plan_post_backward(W1001, ShardingSpec.for_world(S.HYBRID_SHARD_ZERO2, 16, shard_size=8))
    ),
    # docs/examples.md: option combinations
    "mp_bf16_fp32_reduce": Example(
        build=lambda: plan_post_backward(
            W1001, FULL8, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        )
    ),
    "mp_bf16": Example(
        build=lambda: plan_post_backward(W1001, FULL8, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    ),
    "offload_accumulate": Example(
        build=lambda: plan_post_backward(
            W1001, FULL8, offload=CPUOffload(offload_params=True), flags=StepFlags(accumulate=True)
        )
    ),
    "use_orig_params": Example(
        build=lambda: plan_post_backward(ORIG, ShardingSpec.for_world(S.FULL_SHARD, 4, rank=3), use_orig_params=True)
    ),
    "no_sync_first": Example(build=lambda: plan_post_backward(W1001, FULL8, flags=StepFlags(sync_gradients=False))),
    "no_sync_zero2": Example(
        build=lambda: plan_post_backward(
            W1001,
            ShardingSpec.for_world(S.SHARD_GRAD_OP, 8),
            flags=StepFlags(sync_gradients=False, pending_unsharded=True),
        )
    ),
    "no_sync_final": Example(build=lambda: plan_post_backward(W1001, FULL8, flags=StepFlags(pending_unsharded=True))),
    "hybrid_defer": Example(
        build=lambda: plan_post_backward(W1001, HYBRID32, flags=StepFlags(requires_all_reduce=False))
    ),
    "hybrid_defer_final": Example(
        build=lambda: plan_post_backward(W1001, HYBRID32, flags=StepFlags(pending_partial=True))
    ),
    "hybrid_user_hook": Example(build=lambda: plan_post_backward(W1001, HYBRID32, comm_hook=CommHook.USER)),
    "hybrid_in_collective": Example(build=lambda: plan_post_backward(W1001, HYBRID32, division=NCCL_IN_COLLECTIVE)),
    # docs/plan-reference.md: the simulated timeline
    "hybrid_302m": Example(
        build=lambda: plan_post_backward(
            FlatParamLayout.of([("w", (302_000_000,))], torch.float32),
            HYBRID32,
            mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16),
        ),
        units=3,
        backward_ms=3.0,
    ),
    # docs/unshard.md: the backward all-gathers of a 4-unit chain, with and without BACKWARD_PRE
    "chain_8m_pre": Example(
        build=lambda: plan_post_backward(FlatParamLayout.of([("w", (8_000_000,))], torch.float32), FULL8),
        units=4,
        backward_ms=0.3,
        unshard=_chain,
    ),
    "chain_8m_none": Example(
        build=lambda: plan_post_backward(FlatParamLayout.of([("w", (8_000_000,))], torch.float32), FULL8),
        units=4,
        backward_ms=0.3,
        unshard=lambda: _chain(prefetch=None),
    ),
    # docs/verifier.md: a sound base plan and one broken variant per rule
    "verifier_base": Example(build=verifier_base),
    "break_use_before_write": Example(build=lambda: without(verifier_base(), Input)),
    "break_use_after_free": Example(build=break_use_after_free),
    "break_redefined": Example(build=break_redefined),
    "break_unsynced_stream": Example(build=lambda: without(verifier_base(), WaitStream)),
    "break_unsafe_reuse": Example(build=lambda: without(verifier_base(), RecordStream)),
    "break_dtype_mismatch": Example(
        build=lambda: retarget(verifier_base(), "shard", lambda b: replace(b, dtype=torch.bfloat16))
    ),
    "break_numel_mismatch": Example(build=lambda: retarget(verifier_base(), "shard", lambda b: replace(b, numel=3))),
    "break_device_mismatch": Example(
        build=lambda: retarget(verifier_base(), "shard", lambda b: replace(b, device=Device.HOST))
    ),
    "break_reduction": Example(build=break_reduction),
    "break_division": Example(build=lambda: without(verifier_base(), Divide)),
    "break_dropped_gradient": Example(build=break_dropped_gradient),
    "break_leak": Example(build=break_leak),
    "break_hand_off": Example(build=break_hand_off),
    "break_views": Example(build=break_views),
    "break_reshard": Example(build=lambda: without(verifier_base(), FreeUnshardedParam)),
}
"""Every named configuration a document may show."""


SCHEDULES: Mapping[str, ScheduleExample] = {
    # docs/unshard.md: the 4-unit chain under each backward prefetch mode
    "chain_pre": ScheduleExample(build=_chain),
    "chain_post": ScheduleExample(build=lambda: _chain(prefetch=BackwardPrefetch.BACKWARD_POST)),
    "chain_none_forward_prefetch": ScheduleExample(build=lambda: _chain(prefetch=None, forward_prefetch=True)),
    "chain_zero2": ScheduleExample(build=lambda: _chain(reshard_after_forward=False)),
    # docs/verifier.md: one broken variant of chain_pre per check_unshard rule
    "break_ungathered_use": ScheduleExample(build=lambda: with_actions(_chain(), {(_E.PRE_BACKWARD, 3): (_g(2),)})),
    "break_double_gather": ScheduleExample(
        build=lambda: with_actions(_chain(), {(_E.PRE_BACKWARD, 3): (_g(3), _a(3), _g(2))})
    ),
    "break_unsafe_reshard": ScheduleExample(build=lambda: with_actions(_chain(), {(_E.POST_BACKWARD, 3): (_r(3),)})),
    "break_prefetch_depth": ScheduleExample(
        build=lambda: with_actions(_chain(), {(_E.PRE_BACKWARD, 0): (_g(3), _g(2)), (_E.PRE_BACKWARD, 3): (_a(3),)})
    ),
    "break_unawaited_gather": ScheduleExample(
        build=lambda: with_actions(_chain(), {(_E.PRE_BACKWARD, 1): (_a(1), _g(2))})
    ),
    "break_unused_gather": ScheduleExample(
        build=lambda: with_actions(_chain(), {(_E.POST_BACKWARD, 1): (_g(3), _a(3))})
    ),
    "break_forward_reshard": ScheduleExample(build=lambda: with_actions(_chain(), {(_E.POST_FORWARD, 2): ()})),
}
"""Every named all-gather schedule a document may show."""


def _seed_timeline(key: str) -> str:
    result = next(r for r in seed_calibration().results if r.row.key == key)
    return format_seed_timeline(result)


SIM_BLOCKS: Mapping[str, Callable[[], str]] = {
    # docs/async-hsdp.md: `fsdp-sim --no-timeline`
    "seed_table": lambda: format_seed_table(seed_calibration()),
    # docs/async-hsdp.md: `fsdp-sim --no-timeline --concurrent-collectives --contention 1.25`
    "concurrent_contention_1_25": lambda: format_seed_table(
        seed_calibration(replace(SEED_PARAMETERS, contention=1.25), one_collective_per_group=False)
    ),
    # docs/async-hsdp.md: the timelines `fsdp-sim` prints, one per row
    **{f"timeline_{row.key}": partial(_seed_timeline, row.key) for row in SEED_ROWS},
}
"""Every ``fsdp-sim`` output a document may show."""


_FIT_7B = (
    *("--model", "llama-7b", "--world-size", "64", "--strategy", "HYBRID_SHARD", "--shard-size", "8"),
    *("--param-dtype", "bf16", "--reduce-dtype", "fp32", "--batch-size", "1", "--seq", "4096"),
)

_FIT_7B_16 = (
    *("--model", "llama-7b", "--world-size", "16"),
    *("--param-dtype", "bf16", "--reduce-dtype", "fp32", "--batch-size", "1", "--seq", "4096"),
)

CLI_BLOCKS: Mapping[str, tuple[str, ...]] = {
    # docs/user-guide.md, "Will it fit?": Llama 2 7B on 64 GPUs as 8 x 8 HSDP with bf16
    "fit_7b_hsdp": _FIT_7B,
    "fit_7b_hsdp_no_sync": (*_FIT_7B, "--grad-accum", "4"),
    # docs/user-guide.md, "Will it fit?": the same with fully_shard on each block, then the root
    "fit_7b_fully_shard_hsdp": (*_FIT_7B, "--api", "fully_shard"),
    # docs/user-guide.md, "Will it fit?": fully_shard over 16 ranks (8 per node), then hpZ's groups of 8
    "fit_7b_fully_shard_16": (*_FIT_7B_16, "--api", "fully_shard"),
    "fit_7b_fully_shard_16_hpz": (*_FIT_7B_16, "--api", "fully_shard", "--reshard-after-forward", "8"),
    # docs/from-fsdp2.md: one block of its script (LayerNorm, up and down) as a fully_shard unit
    "fully_shard_block": (
        *("--api", "fully_shard", "--shapes", "64,64,256x64,256,64x256,64", "--world-size", "2"),
        *("--param-dtype", "bf16", "--reduce-dtype", "fp32", "--backend", "gloo"),
    ),
}
"""Every ``fsdp-plan`` command line a document shows the output of (without ``fsdp-plan``)."""
