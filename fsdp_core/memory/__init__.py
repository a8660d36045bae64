"""Memory, predicted from the plans and the all-gather schedule: what one post-backward plan
holds op by op (``plan_memory``) and the hooks of a backward in order (``backward_memory``);
what the all-gathers hold hook by hook (``unshard_footprints``); what torch's optimizers hold
(``optimizer``); the math libraries' workspaces on a GPU (``workspace``); and a whole model's
bytes per rank by phase and category (``model_memory``), from all of them and autograd's side of
a step (``ActivationTrace``). Sizes are as an ``Allocator`` counts them."""

from fsdp_core.memory.activation_trace import ActivationTrace, Mark, TracePoint
from fsdp_core.memory.allocator import CUDA_CACHING, EXACT, Allocator
from fsdp_core.memory.model_memory import (
    Category,
    ModelMemory,
    ModelMemoryRequest,
    Phase,
    PhasePeak,
    UnitSpec,
    for_rank,
    model_memory,
    optimized_tensors,
    per_param_optimized_tensors,
)
from fsdp_core.memory.optimizer import (
    OptimizedTensor,
    OptimizerKind,
    OptimizerSpec,
    optimizer_state_bytes,
    optimizer_step_bytes,
)
from fsdp_core.memory.plan_memory import (
    BackwardMemory,
    Executor,
    HookFootprint,
    PlanMemory,
    backward_footprints,
    backward_memory,
    plan_memory,
    unsharded_param_bytes,
)
from fsdp_core.memory.unshard_memory import (
    GatherBytes,
    GatherWalk,
    UnshardFootprint,
    gather_bytes,
    per_param_gather_bytes,
    unshard_footprints,
)
from fsdp_core.memory.workspace import Workspaces, cuda_workspaces

__all__ = [
    "CUDA_CACHING",
    "EXACT",
    "ActivationTrace",
    "Allocator",
    "BackwardMemory",
    "Category",
    "Executor",
    "GatherBytes",
    "GatherWalk",
    "HookFootprint",
    "Mark",
    "ModelMemory",
    "ModelMemoryRequest",
    "OptimizedTensor",
    "OptimizerKind",
    "OptimizerSpec",
    "Phase",
    "PhasePeak",
    "PlanMemory",
    "TracePoint",
    "UnitSpec",
    "UnshardFootprint",
    "Workspaces",
    "backward_footprints",
    "backward_memory",
    "cuda_workspaces",
    "for_rank",
    "gather_bytes",
    "model_memory",
    "optimized_tensors",
    "optimizer_state_bytes",
    "optimizer_step_bytes",
    "per_param_gather_bytes",
    "per_param_optimized_tensors",
    "plan_memory",
    "unshard_footprints",
    "unsharded_param_bytes",
]
