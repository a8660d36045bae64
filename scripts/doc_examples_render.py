"""Documentation examples, how a block is printed: for each marker kind, what the block shows
for its named entry of ``scripts/doc_examples_catalog.py`` (a plan table, communication volumes,
verifier findings, a timeline, an all-gather schedule, ``fsdp-sim``'s or ``fsdp-plan``'s output).

``render`` gives a block's body; ``known`` says whether a marker names something it can render.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from fsdp_core import Plan, UnshardSchedule, check_plan, check_unshard, comm_volume, format_plan, format_unshard
from fsdp_core.sim import format_timeline, simulate_timeline
from scripts.doc_examples_catalog import CLI_BLOCKS, EXAMPLES, SCHEDULES, SIM_BLOCKS, Example, ScheduleExample


def _cli(argv: Sequence[str]) -> str:
    import contextlib
    import io

    from fsdp_shell.cli.plan import main as plan_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = plan_main(list(argv))
    if status != 0:
        raise RuntimeError(f"fsdp-plan {' '.join(argv)} exited {status}")
    return out.getvalue()


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _comm(plan: Plan) -> str:
    volumes = comm_volume(plan)
    if not volumes:
        return "(no communication)"
    lines = [
        f"op {v.op_index:>2}  {v.op:<14} as {v.collective:<14} over {v.group.value} x{v.group_size}: "
        f"in {v.input_numel} -> out {v.output_numel} {_dtype(v.dtype)}, {v.bytes} B sent per rank"
        for v in volumes
    ]
    lines.append(f"total {sum(v.bytes for v in volumes)} B sent per rank")
    return "\n".join(lines)


def _problems(plan: Plan) -> str:
    found = check_plan(plan)
    return "\n".join(str(p) for p in found) if found else "(sound)"


def _timeline(example: Example) -> str:
    plan = example.build()
    unshard = None if example.unshard is None else example.unshard()
    entries = simulate_timeline(plan, units=example.units, backward_seconds=example.backward_ms / 1e3, unshard=unshard)
    return format_timeline(entries)


def _unshard_problems(schedule: UnshardSchedule) -> str:
    found = check_unshard(schedule)
    return "\n".join(str(p) for p in found) if found else "(sound)"


KINDS: Mapping[str, Callable[[Example], str]] = {
    "plan": lambda e: format_plan(e.build()),
    "comm": lambda e: _comm(e.build()),
    "problems": lambda e: _problems(e.build()),
    "timeline": _timeline,
}
"""Marker kind -> what the block shows for an example."""

SCHEDULE_KINDS: Mapping[str, Callable[[ScheduleExample], str]] = {
    "schedule": lambda e: format_unshard(e.build()),
    "unshard_problems": lambda e: _unshard_problems(e.build()),
}
"""Marker kind -> what the block shows for an all-gather schedule."""


def known(kind: str, name: str) -> str | None:
    """None when ``kind:name`` can be rendered, else what is unknown (``kind`` or ``example``)."""
    if kind in KINDS:
        return None if name in EXAMPLES else "example"
    if kind in SCHEDULE_KINDS:
        return None if name in SCHEDULES else "example"
    if kind == "sim":
        return None if name in SIM_BLOCKS else "example"
    if kind == "cli":
        return None if name in CLI_BLOCKS else "example"
    return "kind"


def render(kind: str, name: str) -> str:
    """The body of block ``kind:name``: a fenced ``text`` block ending in a newline."""
    if kind == "sim":
        text = SIM_BLOCKS[name]().rstrip("\n")
    elif kind == "cli":
        text = _cli(CLI_BLOCKS[name]).rstrip("\n")
    elif kind in SCHEDULE_KINDS:
        text = SCHEDULE_KINDS[kind](SCHEDULES[name]).rstrip("\n")
    else:
        text = KINDS[kind](EXAMPLES[name]).rstrip("\n")
    return f"```text\n{text}\n```\n"
