"""Memory, predicted from the plans: what one post-backward plan holds op by op
(``plan_memory``); the whole model's per-rank memory builds on it."""

from fsdp_core.memory.plan_memory import (
    GLOO_ALL_TO_ALL_MAX_BYTES,
    Executor,
    HookFootprint,
    PlanMemory,
    backward_footprints,
    plan_memory,
    unsharded_param_bytes,
)

__all__ = [
    "GLOO_ALL_TO_ALL_MAX_BYTES",
    "Executor",
    "HookFootprint",
    "PlanMemory",
    "backward_footprints",
    "plan_memory",
    "unsharded_param_bytes",
]
