"""How plans execute: every decision a runtime makes about where and when a plan's work runs,
made once here and used, not restated, by the runtime that runs it (``fsdp_shell.runtime``), the
memory model that prices it (``fsdp_core.memory``) and the simulator that times it
(``fsdp_core.sim``).

- ``lane``: the CPU runtime's placement of each op on the host thread or the lane
  (``LaneOrder``: ``compute``, ``collective``, ``on_host``, ``free``, ``begin_plan``, ``drain``),
  ``PLANS_IN_FLIGHT``, when the lane issues shard-group collectives, and the forms gloo's
  collectives take and the sizes that choose them.
"""

from fsdp_core.execution.lane import (
    ALL_TO_ALL_MAX_BYTES,
    ASYNC_GATHER_MAX_BYTES,
    BROADCAST_GATHER_MIN_BYTES,
    PLANS_IN_FLIGHT,
    LaneOrder,
    Place,
    ScatterForm,
    gather_by_broadcasts,
    gather_waits,
    lane_issues_shard,
    scatter_form,
)

__all__ = [
    "ALL_TO_ALL_MAX_BYTES",
    "ASYNC_GATHER_MAX_BYTES",
    "BROADCAST_GATHER_MIN_BYTES",
    "PLANS_IN_FLIGHT",
    "LaneOrder",
    "Place",
    "ScatterForm",
    "gather_by_broadcasts",
    "gather_waits",
    "lane_issues_shard",
    "scatter_form",
]
