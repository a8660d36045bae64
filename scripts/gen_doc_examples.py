"""Keep the worked examples in ``docs/*.md`` true: regenerate them from the Python API, or check them.

A generated block sits between two marker comments and holds one fenced ``text`` block::

    <!-- plan:full_shard -->
    ```text
    ...what format_plan prints...
    ```
    <!-- /plan:full_shard -->

The marker's kind says what is printed for the example named after the colon:

- ``plan``: ``format_plan(plan)``, exactly;
- ``comm``: one line per collective from ``comm_volume(plan)`` (per-rank ring volume);
- ``problems``: ``check_plan(plan)``, one problem per line (``(sound)`` when there is none);
- ``timeline``: ``format_timeline(simulate_timeline(plan, ...))`` with the example's units (and
  all-gather schedule, if it has one);
- ``schedule``: ``format_unshard(schedule)`` for an all-gather schedule of ``SCHEDULES``;
- ``unshard_problems``: ``check_unshard(schedule)``, one problem per line (``(sound)`` when none);
- ``sim``: what ``fsdp-sim`` prints for a name of ``SIM_BLOCKS``: the seed table
  (``format_seed_table``), or one row's timeline (``format_seed_timeline``);
- ``cli``: what ``fsdp-plan`` prints for the command line of ``CLI_BLOCKS`` (a whole model's
  predicted memory, ``--model``), exactly.

Usage::

    python scripts/gen_doc_examples.py           # rewrite every stale block in place
    python scripts/gen_doc_examples.py --check   # exit 1 and name every stale block

Examples are built through ``fsdp_core``'s public API (and ``fsdp-plan``'s entry point for
``cli``); nothing here reads a plan from the documents.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from fsdp_core import (
    AllReduce,
    AwaitGather,
    BackendCaps,
    BackwardPrefetch,
    Buffer,
    CommHook,
    CPUOffload,
    Device,
    Divide,
    Division,
    DivisionPolicy,
    Event,
    FlatParamLayout,
    Free,
    FreeUnshardedParam,
    Gather,
    GradViews,
    Group,
    HandOff,
    Input,
    MixedPrecision,
    Op,
    Pad,
    Plan,
    RecordStream,
    ReduceOpSpec,
    ReduceScatter,
    Reshard,
    ShardingSpec,
    ShardingStrategy,
    StepFlags,
    Stream,
    UnshardAction,
    UnshardRequest,
    UnshardSchedule,
    WaitStream,
    check_plan,
    check_unshard,
    comm_volume,
    format_plan,
    format_unshard,
    plan_post_backward,
    plan_unshard,
)
from fsdp_core.sim import (
    SEED_PARAMETERS,
    SEED_ROWS,
    format_seed_table,
    format_seed_timeline,
    format_timeline,
    seed_calibration,
    simulate_timeline,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_D = TypeVar("_D", bound="DataclassInstance")

__all__ = [
    "DOCS",
    "EXAMPLES",
    "SCHEDULES",
    "SIM_BLOCKS",
    "Example",
    "ScheduleExample",
    "main",
    "regenerate",
    "render",
    "stale_blocks",
]

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
"""The directory whose ``*.md`` files hold generated blocks."""

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

TINY = FlatParamLayout.of([("w", (3,))], torch.float32)
"""Three elements over two ranks: the verifier's base plan."""

TINY_ORIG = FlatParamLayout.of([("a", (3,)), ("b", (2,))], torch.float32, align=True)

FULL8 = ShardingSpec.for_world(S.FULL_SHARD, 8)
HYBRID32 = ShardingSpec.for_world(S.HYBRID_SHARD, 32, shard_size=8)
FULL2 = ShardingSpec.for_world(S.FULL_SHARD, 2)
NCCL_IN_COLLECTIVE = Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=BackendCaps.for_backend("nccl"))


def _verifier_base() -> Plan:
    return plan_post_backward(TINY, FULL2)


def _with_ops(plan: Plan, ops: Sequence[Op]) -> Plan:
    return replace(plan, ops=tuple(ops))


def _without(plan: Plan, kind: type) -> Plan:
    """``plan`` minus every op of type ``kind``."""
    return _with_ops(plan, [op for op in plan.ops if not isinstance(op, kind)])


def _replace_buffers(op: _D, changes: dict[str, Buffer]) -> _D:
    return replace(op, **changes)


def _retarget(plan: Plan, name: str, new: Callable[[Buffer], Buffer]) -> Plan:
    """``plan`` with the buffer called ``name`` replaced by ``new(buffer)`` in every op."""

    def fix(op: Op) -> Op:
        changes = {
            field: new(value)
            for field in ("buffer", "src", "dst")
            if isinstance(value := getattr(op, field, None), Buffer) and value.name == name
        }
        return _replace_buffers(op, changes) if changes else op

    return _with_ops(plan, [fix(op) for op in plan.ops])


def _index(ops: Sequence[Op], kind: type, start: int = 0) -> int:
    """Index of the first op of type ``kind`` at or after ``start``."""
    return next(i for i in range(start, len(ops)) if isinstance(ops[i], kind))


def _break_use_after_free() -> Plan:
    base = _verifier_base()
    ops = list(base.ops)
    rs = _index(ops, ReduceScatter)
    ops.insert(rs, ops.pop(_index(ops, Free, rs)))
    return _with_ops(base, ops)


def _break_redefined() -> Plan:
    base = _verifier_base()
    ops = list(base.ops)
    pad = _index(ops, Pad)
    ops.insert(pad + 1, ops[pad])
    return _with_ops(base, ops)


def _break_reduction() -> Plan:
    base = _verifier_base()
    ops = list(base.ops)
    rs = _index(ops, ReduceScatter)
    op = ops[rs]
    assert isinstance(op, ReduceScatter)
    ops.insert(rs + 1, AllReduce(buffer=op.dst, group=Group.SHARD, reduce_op=ReduceOpSpec(), stream=op.stream))
    return _with_ops(base, ops)


def _break_dropped_gradient() -> Plan:
    base = _verifier_base()
    accumulating = plan_post_backward(TINY, FULL2, flags=StepFlags(accumulate=True))
    return replace(base, request=accumulating.request)


def _break_leak() -> Plan:
    base = _verifier_base()
    return _with_ops(base, [op for op in base.ops if not (isinstance(op, Free) and op.buffer.name == "grad.padded")])


def _break_hand_off() -> Plan:
    base = _verifier_base()
    return _with_ops(
        base,
        [replace(op, stream=Stream.POST_BACKWARD) if isinstance(op, HandOff) else op for op in base.ops],
    )


def _break_views() -> Plan:
    spec = ShardingSpec.for_world(S.FULL_SHARD, 2)
    base = plan_post_backward(TINY_ORIG, spec, use_orig_params=True)
    rank1 = spec.shard_views(TINY_ORIG, rank=1)
    return _with_ops(base, [replace(op, views=rank1) if isinstance(op, GradViews) else op for op in base.ops])


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


def _with_actions(
    schedule: UnshardSchedule, changes: Mapping[tuple[Event, int], tuple[UnshardAction, ...]]
) -> UnshardSchedule:
    """``schedule`` with the actions of the given (event, unit) steps replaced."""
    steps = tuple(replace(s, actions=changes.get((s.event, s.unit), s.actions)) for s in schedule.steps)
    return UnshardSchedule(request=schedule.request, steps=steps)


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
    "verifier_base": Example(build=_verifier_base),
    "break_use_before_write": Example(build=lambda: _without(_verifier_base(), Input)),
    "break_use_after_free": Example(build=_break_use_after_free),
    "break_redefined": Example(build=_break_redefined),
    "break_unsynced_stream": Example(build=lambda: _without(_verifier_base(), WaitStream)),
    "break_unsafe_reuse": Example(build=lambda: _without(_verifier_base(), RecordStream)),
    "break_dtype_mismatch": Example(
        build=lambda: _retarget(_verifier_base(), "shard", lambda b: replace(b, dtype=torch.bfloat16))
    ),
    "break_numel_mismatch": Example(build=lambda: _retarget(_verifier_base(), "shard", lambda b: replace(b, numel=3))),
    "break_device_mismatch": Example(
        build=lambda: _retarget(_verifier_base(), "shard", lambda b: replace(b, device=Device.HOST))
    ),
    "break_reduction": Example(build=_break_reduction),
    "break_division": Example(build=lambda: _without(_verifier_base(), Divide)),
    "break_dropped_gradient": Example(build=_break_dropped_gradient),
    "break_leak": Example(build=_break_leak),
    "break_hand_off": Example(build=_break_hand_off),
    "break_views": Example(build=_break_views),
    "break_reshard": Example(build=lambda: _without(_verifier_base(), FreeUnshardedParam)),
}
"""Every named configuration a document may show."""


SCHEDULES: Mapping[str, ScheduleExample] = {
    # docs/unshard.md: the 4-unit chain under each backward prefetch mode
    "chain_pre": ScheduleExample(build=_chain),
    "chain_post": ScheduleExample(build=lambda: _chain(prefetch=BackwardPrefetch.BACKWARD_POST)),
    "chain_none_forward_prefetch": ScheduleExample(build=lambda: _chain(prefetch=None, forward_prefetch=True)),
    "chain_zero2": ScheduleExample(build=lambda: _chain(reshard_after_forward=False)),
    # docs/verifier.md: one broken variant of chain_pre per check_unshard rule
    "break_ungathered_use": ScheduleExample(build=lambda: _with_actions(_chain(), {(_E.PRE_BACKWARD, 3): (_g(2),)})),
    "break_double_gather": ScheduleExample(
        build=lambda: _with_actions(_chain(), {(_E.PRE_BACKWARD, 3): (_g(3), _a(3), _g(2))})
    ),
    "break_unsafe_reshard": ScheduleExample(build=lambda: _with_actions(_chain(), {(_E.POST_BACKWARD, 3): (_r(3),)})),
    "break_prefetch_depth": ScheduleExample(
        build=lambda: _with_actions(_chain(), {(_E.PRE_BACKWARD, 0): (_g(3), _g(2)), (_E.PRE_BACKWARD, 3): (_a(3),)})
    ),
    "break_unawaited_gather": ScheduleExample(
        build=lambda: _with_actions(_chain(), {(_E.PRE_BACKWARD, 1): (_a(1), _g(2))})
    ),
    "break_unused_gather": ScheduleExample(
        build=lambda: _with_actions(_chain(), {(_E.POST_BACKWARD, 1): (_g(3), _a(3))})
    ),
    "break_forward_reshard": ScheduleExample(build=lambda: _with_actions(_chain(), {(_E.POST_FORWARD, 2): ()})),
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

CLI_BLOCKS: Mapping[str, tuple[str, ...]] = {
    # docs/user-guide.md, "Will it fit?": Llama 2 7B on 64 GPUs as 8 x 8 HSDP with bf16
    "fit_7b_hsdp": _FIT_7B,
    "fit_7b_hsdp_no_sync": (*_FIT_7B, "--grad-accum", "4"),
}
"""Every ``fsdp-plan`` command line a document shows the output of (without ``fsdp-plan``)."""


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


# -- rendering ----------------------------------------------------------------------------------


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


def _known(kind: str, name: str) -> str | None:
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


_BLOCK = re.compile(
    r"<!-- (?P<kind>[a-z_]+):(?P<name>[a-z0-9_]+) -->\n(?P<body>.*?)<!-- /(?P=kind):(?P=name) -->",
    re.DOTALL,
)
_MARKER = re.compile(r"<!-- (/?)([a-z_]+):([a-z0-9_]+) -->")


@dataclass(frozen=True, slots=True)
class _Update:
    text: str
    """The document with every block regenerated."""
    stale: tuple[str, ...]
    """``file kind:name`` of every block whose body changed."""
    errors: tuple[str, ...]
    """Markers that name no example or kind, or have no partner."""


def _update(path: Path, text: str) -> _Update:
    stale: list[str] = []
    errors: list[str] = []
    paired = 0

    def fill(m: re.Match[str]) -> str:
        nonlocal paired
        paired += 1
        kind, name, body = m.group("kind"), m.group("name"), m.group("body")
        where = f"{path.name} {kind}:{name}"
        unknown = _known(kind, name)
        if unknown is not None:
            errors.append(f"{where}: unknown {unknown}")
            return m.group(0)
        fresh = render(kind, name)
        if body != fresh:
            stale.append(where)
        return f"<!-- {kind}:{name} -->\n{fresh}<!-- /{kind}:{name} -->"

    new = _BLOCK.sub(fill, text)
    markers = _MARKER.findall(text)
    if len(markers) != 2 * paired:
        unpaired = sorted({f"{k}:{n}" for _, k, n in markers} - {f"{k}:{n}" for k, n, _ in _BLOCK.findall(text)})
        errors.append(f"{path.name}: markers without a partner: {', '.join(unpaired) or '(a name used twice?)'}")
    return _Update(text=new, stale=tuple(stale), errors=tuple(errors))


def _documents(docs: Path) -> list[Path]:
    return sorted(docs.glob("*.md"))


def stale_blocks(docs: Path = DOCS) -> list[str]:
    """Every generated block under ``docs`` that differs from what the API prints now, as
    ``"file kind:name"``, followed by every malformed marker; empty when all are current."""
    out: list[str] = []
    for path in _documents(docs):
        u = _update(path, path.read_text(encoding="utf-8"))
        out += [*u.stale, *u.errors]
    return out


def regenerate(docs: Path = DOCS) -> list[str]:
    """Rewrite every stale block under ``docs`` in place; return what changed (as ``stale_blocks``).

    Malformed markers are reported, never rewritten."""
    changed: list[str] = []
    for path in _documents(docs):
        old = path.read_text(encoding="utf-8")
        u = _update(path, old)
        if u.text != old:
            path.write_text(u.text, encoding="utf-8")
        changed += [*u.stale, *u.errors]
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    """Regenerate (default) or ``--check`` the generated blocks; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any block is stale")
    parser.add_argument("--docs", type=Path, default=DOCS, help=f"directory of Markdown files (default {DOCS})")
    args = parser.parse_args(argv)
    docs: Path = args.docs
    if args.check:
        stale = stale_blocks(docs)
        for item in stale:
            print(f"stale: {item}")
        if stale:
            print("run: python scripts/gen_doc_examples.py", file=sys.stderr)
        return 1 if stale else 0
    for item in regenerate(docs):
        print(f"regenerated: {item}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
