"""How much planning costs: building a plan from scratch vs. a PlanCache hit vs. verifying it.

Run on demand: ``python benchmarks/bench_planning.py``. Prints microseconds per call (median of
repeats); a cache hit is what the shell pays per post-backward.
"""

from __future__ import annotations

import statistics
import timeit

import torch

from fsdp_core import (
    CPUOffload,
    FlatParamLayout,
    MixedPrecision,
    PlanCache,
    PlanRequest,
    ShardingSpec,
    ShardingStrategy,
    StepFlags,
    build_plan,
    check_plan,
)


def _requests() -> dict[str, PlanRequest]:
    layout = FlatParamLayout.of([(f"p{i}", (1000 + i, 7)) for i in range(16)], torch.float32, align=True)
    return {
        "FULL_SHARD": PlanRequest(layout=layout, sharding=ShardingSpec.for_world(ShardingStrategy.FULL_SHARD, 8)),
        "HYBRID_SHARD bf16 offload orig": PlanRequest(
            layout=layout,
            sharding=ShardingSpec.for_world(ShardingStrategy.HYBRID_SHARD, 32, 8),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            offload=CPUOffload(offload_params=True),
            use_orig_params=True,
            flags=StepFlags(accumulate=True),
        ),
    }


def _median_us(fn: object, number: int) -> float:
    assert callable(fn)
    runs = timeit.repeat(fn, number=number, repeat=7)
    return statistics.median(runs) / number * 1e6


def main() -> None:
    cache = PlanCache()
    print(f"{'configuration':<34}{'build':>12}{'cache hit':>12}{'verify':>12}   (us per call)")
    for name, request in _requests().items():
        plan = cache(request)
        build = _median_us(lambda request=request: build_plan(request), 200)
        hit = _median_us(lambda request=request: cache(request), 20000)
        verify = _median_us(lambda plan=plan: check_plan(plan), 200)
        print(f"{name:<34}{build:>12.1f}{hit:>12.2f}{verify:>12.1f}")


if __name__ == "__main__":
    main()
