"""All-gather schedules for people and programs: readable text and JSON-ready values."""

from __future__ import annotations

from fsdp_core.problems import JsonValue, Problem, problems_to_json
from fsdp_core.unshard.schedule import UnshardAction, UnshardSchedule, action_name
from fsdp_core.unshard.verifier import check_unshard

__all__ = ["format_unshard", "unshard_to_json"]


def _actions_text(actions: tuple[UnshardAction, ...]) -> str:
    return ", ".join(f"{action_name(a)} {a.unit}" for a in actions) if actions else "-"


def format_unshard(schedule: UnshardSchedule) -> str:
    """A readable listing of ``schedule``: the request, then one line per step with its actions."""
    r = schedule.request
    prefetch = "none" if r.backward_prefetch is None else r.backward_prefetch.name
    if r.forward_reshards:
        after_forward = "reshard units " + (" ".join(str(u) for u, v in enumerate(r.forward_reshards) if v) or "none")
    else:
        after_forward = "reshard (not the root)" if r.reshard_after_forward else "keep"
    if r.backward_reshards:
        after_backward = "reshard units " + (" ".join(str(u) for u, v in enumerate(r.backward_reshards) if v) or "none")
    elif r.plan_reshards:
        after_backward = "reshard (by the post-backward plan)"
    else:
        after_backward = "reshard at its end" if r.reshard_at_end_of_backward else "keep"
    if r.backward_gathers and not all(r.backward_gathers):
        after_backward += "; not gathered for backward: " + " ".join(
            str(u) for u, v in enumerate(r.backward_gathers) if not v
        )
    lines = [
        f"all-gather schedule: {r.units} unit(s), root {r.root}; backward_prefetch {prefetch}, "
        f"forward_prefetch {r.forward_prefetch}",
        f"  after forward: {after_forward}; after backward: {after_backward}",
        *(
            f"  {name}: " + "; ".join(f"{u} -> {' '.join(map(str, t))}" for u, t in enumerate(lists) if t)
            for name, lists in (
                ("forward prefetch", r.forward_prefetches),
                ("backward prefetch", r.backward_prefetches),
            )
            if any(lists)
        ),
        f"  forward order: {' '.join(map(str, r.forward_order)) or '(not recorded)'}; "
        f"backward order: {' '.join(map(str, r.backward_order)) or '(not recorded)'}",
        "",
    ]
    rows = [(str(i), s.event.value, str(s.unit), _actions_text(s.actions)) for i, s in enumerate(schedule.steps)]
    head = ("#", "event", "unit", "actions")
    widths = [max(len(row[k]) for row in [head, *rows]) for k in range(3)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in [head, *rows]]
    lines.append("other hooks: on demand (gather and await before use; reshard after forward as the strategy says)")
    return "\n".join(lines)


def unshard_to_json(schedule: UnshardSchedule, problems: list[Problem] | None = None) -> dict[str, JsonValue]:
    """``schedule`` as a JSON-ready dict: the request's fields, ``steps`` (``{event, unit,
    actions: [{action, unit}]}``) and ``problems`` (``check_unshard``'s, computed unless given;
    ``op_index`` counts hook events)."""
    r = schedule.request
    found = check_unshard(schedule) if problems is None else problems
    steps: list[JsonValue] = [
        {
            "event": s.event.value,
            "unit": s.unit,
            "actions": [{"action": action_name(a), "unit": a.unit} for a in s.actions],
        }
        for s in schedule.steps
    ]
    return {
        "units": r.units,
        "root": r.root,
        "forward_order": list(r.forward_order),
        "backward_order": list(r.backward_order),
        "reshard_after_forward": r.reshard_after_forward,
        "forward_reshards": [r.reshards_after_forward(u) for u in range(r.units)],
        "forward_prefetches": [list(t) for t in r.forward_prefetches],
        "backward_prefetches": [list(t) for t in r.backward_prefetches],
        "plan_reshards": r.plan_reshards,
        "backward_reshards": [r.plan_reshards_unit(u) for u in range(r.units)],
        "backward_gathers": [r.gathers_for_backward(u) for u in range(r.units)],
        "reshard_at_end_of_backward": r.reshard_at_end_of_backward,
        "backward_prefetch": None if r.backward_prefetch is None else r.backward_prefetch.name,
        "forward_prefetch": r.forward_prefetch,
        "steps": steps,
        "problems": problems_to_json(found),
    }
