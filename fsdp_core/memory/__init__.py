"""Memory, predicted from the plans and the all-gather schedule: what one post-backward plan
holds op by op (``plan_memory``) and the hooks of a backward in order (``backward_footprints``);
what the all-gathers hold hook by hook (``unshard_footprints``). The whole model's per-rank
memory builds on them."""

from fsdp_core.memory.plan_memory import (
    GLOO_ALL_TO_ALL_MAX_BYTES,
    Executor,
    HookFootprint,
    PlanMemory,
    backward_footprints,
    plan_memory,
    unsharded_param_bytes,
)
from fsdp_core.memory.unshard_memory import (
    GLOO_ASYNC_GATHER_MAX_BYTES,
    GatherBytes,
    UnshardFootprint,
    gather_bytes,
    unshard_footprints,
)

__all__ = [
    "GLOO_ALL_TO_ALL_MAX_BYTES",
    "GLOO_ASYNC_GATHER_MAX_BYTES",
    "Executor",
    "GatherBytes",
    "HookFootprint",
    "PlanMemory",
    "UnshardFootprint",
    "backward_footprints",
    "gather_bytes",
    "plan_memory",
    "unshard_footprints",
    "unsharded_param_bytes",
]
