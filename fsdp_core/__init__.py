"""fsdp_core: FSDP's gradient post-processing and all-gather schedule as pure data.

Immutable descriptors go in (``fsdp_core.spec``); a ``Plan`` (an ordered tuple of ops over named
buffers on named streams) comes out (``fsdp_core.plan``); ``check_plan`` proves it sound;
``format_plan`` shows it. On the parameter side (``fsdp_core.unshard``), ``plan_unshard`` turns the
recorded execution order into an ``UnshardSchedule`` that ``check_unshard`` proves sound. Both
verifiers report ``Problem`` values of one ``Rule`` vocabulary (``fsdp_core.problems``). Nothing
here imports ``torch.distributed``, touches a tensor, keeps global state or does I/O.

This facade exports the descriptors, the plan and the all-gather schedule. The simulation of
timelines and whole iterations, which nothing at run time uses, is ``fsdp_core.sim``.
"""

from fsdp_core.execution.lane import PLANS_IN_FLIGHT
from fsdp_core.plan.carry import CARRIED_ROLES, carried_role, step_flags
from fsdp_core.plan.comm import CommVolume, all_gather_volume, comm_volume
from fsdp_core.plan.ops import (
    Accumulate,
    AllReduce,
    AllReduceHookCall,
    Buffer,
    Cast,
    CommHookCall,
    CopyIn,
    Destination,
    Device,
    Divide,
    EndOfBackwardWait,
    Free,
    FreeUnshardedParam,
    GradViews,
    Group,
    HandOff,
    Input,
    InputRole,
    Offload,
    Op,
    Pad,
    RecordStream,
    ReduceScatter,
    Stream,
    WaitStream,
    op_name,
)
from fsdp_core.plan.planner import (
    PER_PARAM_BUILDERS,
    PLAN_BUILDERS,
    PlanCache,
    UnsoundPlanError,
    all_reduce_stream,
    build_plan,
    plan_post_backward,
)
from fsdp_core.plan.render import format_plan, plan_to_json
from fsdp_core.plan.request import Plan, PlanRequest
from fsdp_core.plan.verifier import check_plan
from fsdp_core.problems import Problem, Rule
from fsdp_core.spec.config import (
    HYBRID_STRATEGIES,
    BackwardPrefetch,
    CommHook,
    CPUOffload,
    HybridAllReduce,
    MixedPrecision,
    ShardingStrategy,
    StepFlags,
    parse_member,
)
from fsdp_core.spec.division import (
    BackendCaps,
    DivideFactors,
    Division,
    DivisionPolicy,
    ReduceKind,
    ReduceOpSpec,
    divide_factors,
    fsdp1_predivide_factor,
)
from fsdp_core.spec.events import Event, HookEvent
from fsdp_core.spec.layout import (
    FlatParamLayout,
    ParamSpec,
    ShardBounds,
    ShardingSpec,
    ShardView,
    aligned_numel_for,
    unsharded_views,
)
from fsdp_core.spec.per_param import PerParamLayout, ShardedParam, UnitDtypes, unit_dtypes
from fsdp_core.unshard.render import format_unshard, unshard_to_json
from fsdp_core.unshard.schedule import (
    AwaitGather,
    Gather,
    Reshard,
    UnshardAction,
    UnshardRequest,
    UnshardSchedule,
    UnshardStep,
    action_name,
    per_param_unshard_request,
    plan_unshard,
    unshard_request,
)
from fsdp_core.unshard.verifier import check_unshard

__all__ = [
    "CARRIED_ROLES",
    "HYBRID_STRATEGIES",
    "PER_PARAM_BUILDERS",
    "PLANS_IN_FLIGHT",
    "PLAN_BUILDERS",
    "Accumulate",
    "AllReduce",
    "AllReduceHookCall",
    "AwaitGather",
    "BackendCaps",
    "BackwardPrefetch",
    "Buffer",
    "CPUOffload",
    "Cast",
    "CommHook",
    "CommHookCall",
    "CommVolume",
    "CopyIn",
    "Destination",
    "Device",
    "Divide",
    "DivideFactors",
    "Division",
    "DivisionPolicy",
    "EndOfBackwardWait",
    "Event",
    "FlatParamLayout",
    "Free",
    "FreeUnshardedParam",
    "Gather",
    "GradViews",
    "Group",
    "HandOff",
    "HookEvent",
    "HybridAllReduce",
    "Input",
    "InputRole",
    "MixedPrecision",
    "Offload",
    "Op",
    "Pad",
    "ParamSpec",
    "PerParamLayout",
    "Plan",
    "PlanCache",
    "PlanRequest",
    "Problem",
    "RecordStream",
    "ReduceKind",
    "ReduceOpSpec",
    "ReduceScatter",
    "Reshard",
    "Rule",
    "ShardBounds",
    "ShardView",
    "ShardedParam",
    "ShardingSpec",
    "ShardingStrategy",
    "StepFlags",
    "Stream",
    "UnitDtypes",
    "UnshardAction",
    "UnshardRequest",
    "UnshardSchedule",
    "UnshardStep",
    "UnsoundPlanError",
    "WaitStream",
    "action_name",
    "aligned_numel_for",
    "all_gather_volume",
    "all_reduce_stream",
    "build_plan",
    "carried_role",
    "check_plan",
    "check_unshard",
    "comm_volume",
    "divide_factors",
    "format_plan",
    "format_unshard",
    "fsdp1_predivide_factor",
    "op_name",
    "parse_member",
    "per_param_unshard_request",
    "plan_post_backward",
    "plan_to_json",
    "plan_unshard",
    "step_flags",
    "unit_dtypes",
    "unshard_request",
    "unshard_to_json",
    "unsharded_views",
]
