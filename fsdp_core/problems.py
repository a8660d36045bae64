"""What the two verifiers report: one ``Rule`` vocabulary and one ``Problem`` record.

``check_plan`` (``fsdp_core.plan.verifier``) reports the rules up to ``RESHARD``;
``check_unshard`` (``fsdp_core.unshard.verifier``) those from ``UNGATHERED_USE`` on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, Union

__all__ = ["JsonValue", "Problem", "Rule", "problems_to_json"]

JsonValue = Union[None, bool, int, float, str, list["JsonValue"], dict[str, "JsonValue"]]
"""A value ``json.dumps`` accepts."""


class Rule(enum.Enum):
    """The class of a problem the verifiers report: ``check_plan`` (post-backward plans) and,
    from ``UNGATHERED_USE`` on, ``check_unshard`` (all-gather schedules)."""

    USE_BEFORE_WRITE = "use_before_write"
    USE_AFTER_FREE = "use_after_free"
    REDEFINED = "redefined"
    UNSYNCED_STREAM = "unsynced_stream"
    UNSAFE_REUSE = "unsafe_reuse"
    DTYPE_MISMATCH = "dtype_mismatch"
    NUMEL_MISMATCH = "numel_mismatch"
    DEVICE_MISMATCH = "device_mismatch"
    REDUCTION = "reduction"
    DIVISION = "division"
    DROPPED_GRADIENT = "dropped_gradient"
    LEAK = "leak"
    HAND_OFF = "hand_off"
    VIEWS = "views"
    RESHARD = "reshard"
    UNGATHERED_USE = "ungathered_use"
    DOUBLE_GATHER = "double_gather"
    UNSAFE_RESHARD = "unsafe_reshard"
    PREFETCH_DEPTH = "prefetch_depth"
    UNAWAITED_GATHER = "unawaited_gather"
    UNUSED_GATHER = "unused_gather"
    FORWARD_RESHARD = "forward_reshard"


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """One finding: which rule, where (-1 for the whole), and why."""

    rule: Rule
    op_index: int
    """The plan op, or with ``site="event"`` the hook in ``UnshardRequest.events``; -1 for the
    plan (or the iteration) as a whole."""
    message: str
    site: Literal["op", "event"] = "op"
    """What ``op_index`` counts: plan ops (``check_plan``) or hook events (``check_unshard``)."""

    def __str__(self) -> str:
        whole = "plan" if self.site == "op" else "iteration"
        where = whole if self.op_index < 0 else f"{self.site} {self.op_index}"
        return f"[{self.rule.value}] {where}: {self.message}"


def problems_to_json(problems: list[Problem]) -> list[JsonValue]:
    """Each problem as ``{rule, op_index, message}``."""
    return [{"rule": p.rule.value, "op_index": p.op_index, "message": p.message} for p in problems]
