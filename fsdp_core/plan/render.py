"""Post-backward plans for people and programs: readable text and JSON-ready values."""

from __future__ import annotations

from typing import assert_never

import torch

from fsdp_core.plan.comm import comm_volume
from fsdp_core.plan.ops import (
    Accumulate,
    AllReduce,
    AllReduceHookCall,
    Buffer,
    Cast,
    CommHookCall,
    CopyIn,
    Divide,
    EndOfBackwardWait,
    Free,
    FreeUnshardedParam,
    GradViews,
    HandOff,
    Input,
    Offload,
    Op,
    Pad,
    RecordStream,
    ReduceScatter,
    WaitStream,
    op_name,
)
from fsdp_core.plan.request import Plan
from fsdp_core.plan.verifier import check_plan
from fsdp_core.problems import JsonValue, Problem, problems_to_json

__all__ = ["describe_op", "format_plan", "plan_to_json"]


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def describe_op(op: Op) -> str:
    """One line saying what ``op`` does, buffers written ``name[numel:dtype]``."""
    match op:
        case Input():
            return f"{op.buffer}  ({op.role.value})"
        case WaitStream():
            return f"{op.stream.value} waits for {op.waits_for.value}"
        case EndOfBackwardWait():
            return f"at end of backward: {op.stream.value} waits for {op.waits_for.value}"
        case RecordStream():
            return f"{op.buffer.name} in use on {op.stream.value}"
        case Free():
            return f"{op.buffer.name} back to {op.stream.value}'s pool"
        case FreeUnshardedParam():
            return "reshard: free the unsharded parameters"
        case Cast():
            return f"{op.src} -> {op.dst}"
        case Pad():
            return f"{op.src} -> {op.dst}  (+{op.dst.numel - op.src.numel} zeros)"
        case CopyIn():
            n, world = len(op.layout.params), op.layout.world
            return f"{op.src} -> {op.dst}  ({n} parameter(s)' chunks rank-major over {world}, padded)"
        case Divide():
            return f"{op.buffer.name} /= {op.factor:g}"
        case AllReduceHookCall():
            return f"{op.buffer}  the unit's all-reduce hook, in place"
        case ReduceScatter():
            return f"{op.src} -> {op.dst}  over {op.group.value}, {op.reduce_op}"
        case AllReduce():
            return f"{op.buffer}  over {op.group.value}, {op.reduce_op}"
        case CommHookCall():
            target = "in place" if op.src == op.dst else f"-> {op.dst}"
            return (
                f"{op.hook.value}: {op.src} {target}  over {op.group.value}, "
                f"averages /{op.divides_by}, wire {_dtype(op.wire_dtype)}"
            )
        case Accumulate():
            return f"{op.dst.name} += {op.src.name}"
        case Offload():
            verb = "+=" if op.accumulate else "="
            return f"{op.dst} {verb} {op.src.name}"
        case GradViews():
            shown = ", ".join(
                f"{v.param_name}[{v.offset_in_param}:{v.offset_in_param + v.numel}]" for v in op.views[:4]
            )
            more = f", ... ({len(op.views)} in all)" if len(op.views) > 4 else ""
            return (
                f"orig .grad views of {op.buffer.name}: {shown}{more}"
                if op.views
                else f"no parameter in {op.buffer.name}"
            )
        case HandOff():
            return f"{op.buffer} -> {op.destination.value}"
        case _:
            assert_never(op)


def _header(plan: Plan) -> list[str]:
    r = plan.request
    s = r.sharding
    geometry = (
        f"shard {s.shard_size} x replicate {s.replicate_size}" if s.strategy.is_hybrid else f"world {s.shard_size}"
    )
    unit = "per-parameter unit" if r.per_param else "flat parameter"
    lines = [
        f"post-backward plan: {s.strategy.name}, {geometry}, rank {s.rank}",
        f"  {unit}: {r.layout.total_numel} elements in {len(r.layout.params)} parameter(s), "
        f"padded {r.padded_numel}, shard {r.shard_numel}",
        f"  dtypes: param {_dtype(r.layout.dtype)}, compute {_dtype(r.compute_dtype)}, "
        f"reduce {_dtype(r.reduce_dtype)}, optimizer grad {_dtype(r.grad_dtype)}",
    ]
    if plan.factors is not None:
        f = plan.factors
        ops = (
            f"all-reduce {f.reduce_scatter_op}"
            if not s.strategy.is_sharded
            else f"reduce-scatter {f.reduce_scatter_op}, all-reduce {f.all_reduce_op}"
            if s.strategy.is_hybrid
            else f"reduce-scatter {f.reduce_scatter_op}"
        )
        lines.append(f"  division: pre /{f.pre:g}, post /{f.post:g}, {ops} (total /{f.total:g})")
    flags = r.flags
    lines.append(
        f"  comm hook: {r.comm_hook.value}; offload: {r.offload.offload_params}; use_orig_params: {r.use_orig_params}; "
        f"sync: {flags.sync_gradients}; accumulate: {flags.accumulate}; "
        f"reshard in backward: {plan.should_free_in_backward}"
    )
    if s.strategy.is_hybrid:
        lines.append(f"  replicate all-reduce: {r.hybrid_all_reduce.value}")
    return lines


def format_plan(plan: Plan) -> str:
    """A readable table of ``plan``: a header with the configuration, then one row per op."""
    rows = [(str(i), op.stream.value, op_name(op), describe_op(op)) for i, op in enumerate(plan.ops)]
    head = ("#", "stream", "op", "details")
    widths = [max(len(row[k]) for row in [head, *rows]) for k in range(3)]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in [head, *rows]]
    return "\n".join([*_header(plan), "", *table])


def _buffer_json(b: Buffer) -> JsonValue:
    return {"name": b.name, "numel": b.numel, "dtype": _dtype(b.dtype), "device": b.device.value}


def _op_json(op: Op) -> dict[str, JsonValue]:
    out: dict[str, JsonValue] = {"op": op_name(op), "stream": op.stream.value}
    match op:
        case Input():
            out.update(buffer=_buffer_json(op.buffer), role=op.role.value)
        case WaitStream() | EndOfBackwardWait():
            out.update(waits_for=op.waits_for.value)
        case RecordStream() | Free():
            out.update(buffer=_buffer_json(op.buffer))
        case FreeUnshardedParam():
            pass
        case Cast() | Pad():
            out.update(src=_buffer_json(op.src), dst=_buffer_json(op.dst))
        case CopyIn():
            params: list[JsonValue] = [
                {"name": q.name, "shape": list(q.shape), "shard_dim": q.shard_dim} for q in op.layout.params
            ]
            layout: dict[str, JsonValue] = {"world": op.layout.world, "params": params}
            out.update(src=_buffer_json(op.src), dst=_buffer_json(op.dst), layout=layout)
        case Divide():
            out.update(buffer=_buffer_json(op.buffer), factor=op.factor)
        case AllReduceHookCall():
            out.update(buffer=_buffer_json(op.buffer))
        case ReduceScatter():
            out.update(
                src=_buffer_json(op.src), dst=_buffer_json(op.dst), group=op.group.value, reduce_op=str(op.reduce_op)
            )
        case AllReduce():
            out.update(buffer=_buffer_json(op.buffer), group=op.group.value, reduce_op=str(op.reduce_op))
        case CommHookCall():
            out.update(
                hook=op.hook.value,
                src=_buffer_json(op.src),
                dst=_buffer_json(op.dst),
                group=op.group.value,
                divides_by=op.divides_by,
                wire_dtype=_dtype(op.wire_dtype),
            )
        case Accumulate():
            out.update(dst=_buffer_json(op.dst), src=_buffer_json(op.src))
        case Offload():
            out.update(src=_buffer_json(op.src), dst=_buffer_json(op.dst), accumulate=op.accumulate)
        case GradViews():
            views: list[JsonValue] = [
                {
                    "param": v.param_name,
                    "offset_in_buffer": v.offset_in_buffer,
                    "offset_in_param": v.offset_in_param,
                    "numel": v.numel,
                }
                for v in op.views
            ]
            out.update(buffer=_buffer_json(op.buffer), views=views)
        case HandOff():
            out.update(buffer=_buffer_json(op.buffer), destination=op.destination.value)
        case _:
            assert_never(op)
    return out


def plan_to_json(plan: Plan, problems: list[Problem] | None = None) -> dict[str, JsonValue]:
    """``plan`` as a JSON-ready dict: ``ops``, ``comm`` (per collective: ``collective``, ``group``,
    ``input_numel``, ``output_numel``, ``dtype``, ``bytes``), ``problems`` (the verifier's
    findings, computed unless given) and the configuration."""
    r = plan.request
    found = check_plan(plan) if problems is None else problems
    comm: list[JsonValue] = [
        {
            "collective": v.collective,
            "op": v.op,
            "op_index": v.op_index,
            "group": v.group.value,
            "group_size": v.group_size,
            "input_numel": v.input_numel,
            "output_numel": v.output_numel,
            "dtype": _dtype(v.dtype),
            "bytes": v.bytes,
            "input_bytes": v.input_bytes,
            "output_bytes": v.output_bytes,
        }
        for v in comm_volume(plan)
    ]
    factors: JsonValue = None
    if plan.factors is not None:
        f = plan.factors
        factors = {
            "pre": f.pre,
            "post": f.post,
            "reduce_scatter_op": str(f.reduce_scatter_op),
            "all_reduce_op": str(f.all_reduce_op),
            "total": f.total,
        }
    return {
        "strategy": r.sharding.strategy.name,
        "shard_size": r.sharding.shard_size,
        "replicate_size": r.sharding.replicate_size,
        "rank": r.sharding.rank,
        "layout": "per_param" if r.per_param else "flat",
        "numel": r.layout.total_numel,
        "padded_numel": r.padded_numel,
        "shard_numel": r.shard_numel,
        "compute_dtype": _dtype(r.compute_dtype),
        "reduce_dtype": _dtype(r.reduce_dtype),
        "grad_dtype": _dtype(r.grad_dtype),
        "hybrid_all_reduce": r.hybrid_all_reduce.value,
        "should_free_in_backward": plan.should_free_in_backward,
        "destination": None if plan.destination is None else plan.destination.value,
        "factors": factors,
        "ops": [_op_json(op) for op in plan.ops],
        "comm": comm,
        "comm_bytes": sum(v.bytes for v in comm_volume(plan)),
        "problems": problems_to_json(found),
    }
