"""``fsdp-plan``: print the post-backward plan for a configuration given on the command line.

Shows the plan, its communication volume, the verifier's verdict, the device memory it holds
(``fsdp_core.memory.plan_memory``: on device streams for ``--backend nccl``, on the CPU runtime
for ``gloo``) and a simulated timeline, or one JSON object with ``--json``. With ``--units N``
(N > 1) of a sharded strategy it also shows the all-gather schedule of N equal units in a
chain, its verdict, and the backward all-gathers in the timeline. With ``--model SPEC`` it
shows a whole model instead (``fsdp_shell.predict``): its units and every phase's memory per
rank, by category, predicted without a process group. Exit status: 0 when everything is
sound, 1 when a verifier finds a problem, 2 for an invalid configuration (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

# torch warns at import when NumPy is missing; fsdp-plan never touches NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import torch  # noqa: E402  (after the warning filter)

from fsdp_core import (  # noqa: E402
    BackendCaps,
    BackwardPrefetch,
    CommHook,
    CPUOffload,
    Division,
    DivisionPolicy,
    FlatParamLayout,
    HybridAllReduce,
    MixedPrecision,
    PerParamLayout,
    Plan,
    Problem,
    ShardingSpec,
    ShardingStrategy,
    StepFlags,
    UnshardRequest,
    UnshardSchedule,
    all_gather_volume,
    check_plan,
    check_unshard,
    comm_volume,
    format_plan,
    format_unshard,
    op_name,
    plan_post_backward,
    plan_to_json,
    plan_unshard,
    unshard_request,
    unshard_to_json,
)
from fsdp_core.execution import lane_issues_shard  # noqa: E402
from fsdp_core.memory import Executor, PlanMemory, plan_memory  # noqa: E402
from fsdp_core.problems import JsonValue  # noqa: E402
from fsdp_core.sim import CostModel, describe_cost, format_timeline, simulate_timeline, timeline_to_json  # noqa: E402
from fsdp_shell.cli.parser import OneLineErrorParser, console_script  # noqa: E402

if TYPE_CHECKING:
    from fsdp_shell.predict import Prediction
    from fsdp_shell.predict.spec import LoadedModel

__all__ = [
    "main",
    "parse_backward_prefetch",
    "parse_dtype",
    "plan_from_args",
    "predict_from_args",
    "unshard_from_args",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def parse_dtype(text: str) -> torch.dtype:
    """``float32``/``fp32``/``bfloat16``/... to a ``torch.dtype``."""
    try:
        return DTYPES[text.strip().lower().removeprefix("torch.")]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; accepted: float32, bfloat16, float16, float64"
        ) from None


def parse_backward_prefetch(text: str) -> BackwardPrefetch | None:
    """``BACKWARD_PRE``/``BACKWARD_POST`` (any case) to the member, ``none`` to None; ``ValueError``
    naming ``backward_prefetch`` otherwise."""
    if text.strip().lower() == "none":
        return None
    return BackwardPrefetch.parse(text)


def _numels(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(float(part)) if "e" in part.lower() else int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or a comma-separated list, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every numel must be >= 1, got {text!r}")
    return values


def _shapes(text: str) -> tuple[tuple[tuple[int, ...], int], ...]:
    """``9x6,9,4x8:1`` -> ``(((9, 6), 0), ((9,), 0), ((4, 8), 1))``: shapes and shard dimensions."""
    out = []
    for item in text.split(","):
        shape_text, _, dim_text = item.strip().partition(":")
        try:
            shape = tuple(int(d) for d in shape_text.split("x"))
            dim = int(dim_text) if dim_text else 0
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected shapes like 9x6,9 or 4x8:1, got {text!r}") from None
        out.append((shape, dim))
    return tuple(out)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``fsdp-plan``."""
    p = OneLineErrorParser(
        prog="fsdp-plan",
        description="Print FSDP's post-backward plan for one flat parameter, or one fully_shard unit (--api).",
    )
    p.add_argument(
        "--api",
        default="fsdp1",
        choices=["fsdp1", "fully_shard"],
        help="fsdp1: one flat parameter (default); fully_shard: FSDP2's per-parameter unit",
    )
    p.add_argument(
        "--shapes",
        type=_shapes,
        default=None,
        help="fully_shard: the parameters' shapes, e.g. 9x6,9 (default: each --numel 1-D); "
        "a ':d' suffix shards one on dimension d, e.g. 4x8:1",
    )
    p.add_argument(
        "--strategy", default="FULL_SHARD", help="NO_SHARD, FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, HYBRID_SHARD_ZERO2"
    )
    p.add_argument("--world-size", type=_positive, default=8, help="data-parallel ranks (default 8)")
    p.add_argument(
        "--shard-size", type=_positive, default=None, help="hybrid: ranks per shard group (default: the world size)"
    )
    p.add_argument("--rank", type=int, default=0, help="the rank in the shard group whose plan to show (default 0)")
    p.add_argument(
        "--numel",
        type=_numels,
        default=(1001,),
        help="elements of the flat parameter, or a comma-separated list, one per original parameter",
    )
    p.add_argument(
        "--dtype", type=parse_dtype, default=torch.float32, help="the parameters' own dtype (default float32)"
    )
    p.add_argument("--param-dtype", type=parse_dtype, default=None, help="mixed precision: compute dtype")
    p.add_argument("--reduce-dtype", type=parse_dtype, default=None, help="mixed precision: reduction dtype")
    p.add_argument("--keep-low-precision-grads", action="store_true")
    p.add_argument("--offload", action="store_true", help="CPUOffload(offload_params=True)")
    p.add_argument("--use-orig-params", action="store_true")
    p.add_argument(
        "--comm-hook", default="none", help="none, allreduce, reduce_scatter, fp16_compress, bf16_compress, user"
    )
    p.add_argument("--no-sync", action="store_true", help="a backward inside no_sync()")
    p.add_argument("--accumulate", action="store_true", help="accumulate into an existing sharded gradient")
    p.add_argument(
        "--pending-unsharded", action="store_true", help="an unsharded gradient from earlier no_sync backwards exists"
    )
    p.add_argument(
        "--no-all-reduce", action="store_true", help="hybrid: defer the replicate all-reduce (keep a partial)"
    )
    p.add_argument(
        "--hybrid-all-reduce",
        default="async",
        help="hybrid: async (default; the all-reduce on its own stream, PyTorch PR 106080) or sync "
        "(after the reduce-scatter on the post-backward stream, FSDP1 before it)",
    )
    p.add_argument(
        "--pending-partial", action="store_true", help="hybrid: a partial reduction from earlier backwards exists"
    )
    p.add_argument("--force-full-precision", action="store_true")
    p.add_argument(
        "--division",
        default=None,
        choices=[d.value for d in DivisionPolicy],
        help="pre_post (FSDP1's, the default for --api fsdp1) or in_collective (FSDP2's, the default for fully_shard)",
    )
    p.add_argument(
        "--backend", default="nccl", choices=["nccl", "gloo"], help="backend capabilities for --division in_collective"
    )
    p.add_argument(
        "--divide-factor", type=float, default=None, help="divide the gradient sum by this instead of the world size"
    )
    p.add_argument(
        "--units",
        type=_positive,
        default=1,
        help="timeline: simulate this many equal units' post-backwards back to back (default 1)",
    )
    p.add_argument(
        "--backward-ms",
        type=float,
        default=0.0,
        help="timeline: compute-stream backward time between units, in ms (default 0)",
    )
    p.add_argument(
        "--backward-prefetch",
        default="BACKWARD_PRE",
        help="with --units > 1: BACKWARD_PRE (default), BACKWARD_POST or none",
    )
    p.add_argument(
        "--forward-prefetch",
        action="store_true",
        help="with --units > 1: prefetch the next unit's parameters in forward",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    model = p.add_argument_group("a whole model (--model)")
    model.add_argument(
        "--model",
        default=None,
        metavar="SPEC",
        help="predict a whole model's memory per rank: demo, gpt2-tiny, llama-tiny, gpt2, llama-7b, a Hugging Face "
        "config.json, or package.module:factory",
    )
    model.add_argument(
        "--wrap",
        default="",
        help="comma-separated module classes that become units (default: the model's transformer blocks)",
    )
    model.add_argument("--batch-size", type=_positive, default=8, help="sequences per rank per backward (default 8)")
    model.add_argument(
        "--seq", type=_positive, default=None, help="tokens per sequence (default: the model's context, at most 1024)"
    )
    model.add_argument("--input-shape", type=_numels, default=None, help="a plain module's input, e.g. 8,64")
    model.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd or sgd_momentum")
    model.add_argument(
        "--grad-accum", type=_positive, default=1, help="backwards per step; all but the last in no_sync()"
    )
    model.add_argument(
        "--sync-every-micro-batch",
        action="store_true",
        help="with --grad-accum: every backward reduces, the later ones accumulating into the reduced gradient "
        "(no no_sync())",
    )
    model.add_argument(
        "--reshard-after-forward",
        type=_reshard_after_forward,
        default=None,
        metavar="true|false|N",
        help="--api fully_shard: every call's reshard_after_forward (default: as --strategy says; N: reshard to "
        "groups of N ranks after forward, ZeRO++'s hpZ)",
    )
    model.add_argument(
        "--explicit-prefetch",
        action="store_true",
        help="--api fully_shard: each block's forward prefetches the next block and its backward the one before "
        "(set_modules_to_forward_prefetch / set_modules_to_backward_prefetch)",
    )
    model.add_argument(
        "--tflops", type=_positive_float, default=100.0, help="step time: sustained TFLOP/s per device (default 100)"
    )
    model.add_argument("--ranks-per-node", type=_positive, default=8, help="step time: ranks per node (default 8)")
    model.add_argument(
        "--intra-node-gbps", type=_positive_float, default=150.0, help="step time: GB/s per rank inside a node"
    )
    model.add_argument(
        "--inter-node-gbps", type=_positive_float, default=25.0, help="step time: GB/s per rank across nodes"
    )
    return p


def _reshard_after_forward(text: str) -> bool | int:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return _positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected true, false or a positive int, got {text!r}") from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def plan_from_args(args: argparse.Namespace) -> Plan:
    """Build the plan an ``fsdp-plan`` command line asks for; raises ``ValueError``/``TypeError``."""
    strategy = ShardingStrategy.parse(str(args.strategy))
    sharding = ShardingSpec.for_world(strategy, args.world_size, args.shard_size, rank=args.rank)
    numels: tuple[int, ...] = args.numel
    names = ["w"] if len(numels) == 1 else [f"p{i}" for i in range(len(numels))]
    mp = MixedPrecision(
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        keep_low_precision_grads=args.keep_low_precision_grads,
    )
    layout: FlatParamLayout | PerParamLayout
    if args.api == "fully_shard":
        shapes = args.shapes or tuple(((k,), 0) for k in numels)
        names = ["w"] if len(shapes) == 1 else [f"p{i}" for i in range(len(shapes))]
        layout = PerParamLayout.of([(n, s, d) for n, (s, d) in zip(names, shapes)], args.dtype, sharding.shard_size)
    else:
        if args.shapes is not None:
            raise ValueError("--shapes: only --api fully_shard shards parameters by shape; use --numel for a flat one")
        align_dtype = mp.compute_dtype(args.dtype)
        layout = FlatParamLayout.of(
            [(n, (k,)) for n, k in zip(names, numels)], args.dtype, align=args.use_orig_params, align_dtype=align_dtype
        )
    flags = StepFlags(
        sync_gradients=not args.no_sync,
        accumulate=args.accumulate,
        pending_unsharded=args.pending_unsharded,
        requires_all_reduce=not args.no_all_reduce,
        pending_partial=args.pending_partial,
        force_full_precision=args.force_full_precision,
    )
    policy = args.division or ("in_collective" if args.api == "fully_shard" else "pre_post")
    division = Division(
        policy=DivisionPolicy(policy), backend=BackendCaps.for_backend(args.backend), factor=args.divide_factor
    )
    return plan_post_backward(
        layout,
        sharding,
        mixed_precision=mp,
        offload=CPUOffload(offload_params=args.offload),
        comm_hook=CommHook.parse(str(args.comm_hook)),
        division=division,
        use_orig_params=args.use_orig_params,
        hybrid_all_reduce=HybridAllReduce.parse(str(args.hybrid_all_reduce)),
        flags=flags,
    )


def unshard_from_args(args: argparse.Namespace, plan: Plan) -> UnshardSchedule | None:
    """The all-gather schedule of ``--units`` equal units in a chain (root 0 wrapping the others)
    for ``plan``'s request, as the runtime records it (``unshard_request``), or None with one unit
    or ``NO_SHARD`` in the parameters' own dtype (nothing is ever gathered). Parses
    ``--backward-prefetch``; raises ``ValueError``."""
    prefetch = parse_backward_prefetch(str(args.backward_prefetch))
    r = plan.request
    low_precision = r.compute_dtype != r.layout.dtype
    if args.units < 2 or not (r.sharding.strategy.is_sharded or low_precision):
        return None
    chain = UnshardRequest.chain(args.units, reshard_after_forward=False, plan_reshards=False)
    return plan_unshard(
        unshard_request(
            units=chain.units,
            root=chain.root,
            forward_order=chain.forward_order,
            backward_order=chain.backward_order,
            strategy=r.sharding.strategy,
            low_precision=low_precision,
            sync_gradients=r.flags.sync_gradients,
            backward_prefetch=prefetch,
            forward_prefetch=args.forward_prefetch,
        )
    )


def _verdict(name: str, problems: list[Problem]) -> str:
    return f"{name}: sound" if not problems else f"{name}: UNSOUND\n" + "\n".join(f"  {p}" for p in problems)


def _comm_table(plan: Plan) -> str:
    volumes = comm_volume(plan)
    if not volumes:
        return "communication: none"
    lines = ["communication per rank (ring algorithm):"]
    for v in volumes:
        lines.append(
            f"  op {v.op_index:>2} {v.collective:<14} {v.group.value:<9} x{v.group_size:<5} "
            f"in {v.input_numel} -> out {v.output_numel} {str(v.dtype).removeprefix('torch.')}: "
            f"{v.bytes / 2**20:,.2f} MiB on the wire"
        )
    lines.append(f"  total {sum(v.bytes for v in volumes) / 2**20:,.2f} MiB")
    return "\n".join(lines)


def _executor(args: argparse.Namespace) -> Executor:
    return Executor.CPU_LANE if args.backend == "gloo" else Executor.STREAMS


def _memory(plan: Plan, executor: Executor) -> PlanMemory:
    """As the runtime holds it: on the CPU a sync hybrid all-reduce gives the all-gathers a
    group of their own, so the lane issues shard-group reductions too."""
    return plan_memory(plan, executor, lane_issues_shard=lane_issues_shard(plan.request.hybrid_all_reduce))


def _memory_table(plan: Plan, executor: Executor) -> str:
    m = _memory(plan, executor)
    where = "the CPU runtime (gloo)" if executor is Executor.CPU_LANE else "device streams"
    at = "at the start" if m.peak_op < 0 else f"during op {m.peak_op} {op_name(plan.ops[m.peak_op])}"
    return "\n".join(
        [
            f"memory on the device, bytes since the plan's start, on {where}:",
            f"  peak       {m.peak:+,} B ({at})",
            f"  hook's end {m.after_hook:+,} B ({m.returned_later:,} B of it freed, returned at a later wait)",
            f"  plan's end {m.end:+,} B",
            f"  found {m.inputs:,} B of gradients; frees the unsharded parameter ({m.unsharded:,} B); "
            f"hands off {m.handed_off:,} B",
        ]
    )


def _memory_json(plan: Plan, executor: Executor) -> dict[str, JsonValue]:
    m = _memory(plan, executor)
    return {
        "executor": executor.value,
        "after": list[JsonValue](m.after),
        "peak": m.peak,
        "peak_op": m.peak_op,
        "after_hook": m.after_hook,
        "hook_peak": m.hook_peak,
        "returned_later": m.returned_later,
        "end": m.end,
        "inputs": m.inputs,
        "unsharded": m.unsharded,
        "handed_off": m.handed_off,
    }


def predict_from_args(args: argparse.Namespace) -> tuple[Prediction, LoadedModel]:
    """The whole-model prediction an ``fsdp-plan --model`` command line asks for; raises
    ``ValueError``/``TypeError``. Loads ``fsdp_shell.predict`` (the unit-building code, no
    process group) only then: the plan of one flat parameter needs none of it."""
    from fsdp_shell.predict import predict_memory
    from fsdp_shell.predict.spec import load_model

    loaded = load_model(
        str(args.model),
        batch_size=args.batch_size,
        seq=args.seq,
        input_shape=args.input_shape,
        wrap=[w.strip() for w in str(args.wrap).split(",") if w.strip()],
    )
    fully_shard = args.api == "fully_shard"
    mp = MixedPrecision(
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        keep_low_precision_grads=args.keep_low_precision_grads,
    )
    prediction = predict_memory(
        loaded.module,
        loaded.step,
        world_size=args.world_size,
        shard_size=args.shard_size,
        sharding_strategy=str(args.strategy),
        mixed_precision=mp,
        cpu_offload=CPUOffload(offload_params=args.offload),
        auto_wrap_policy=set(loaded.wrap) or None,
        use_orig_params=args.use_orig_params,
        backward_prefetch=None if fully_shard else parse_backward_prefetch(str(args.backward_prefetch)),
        forward_prefetch=args.forward_prefetch,
        hybrid_all_reduce=str(args.hybrid_all_reduce),
        optimizer=str(args.optimizer),
        accumulate=args.grad_accum,
        no_sync=not args.sync_every_micro_batch,
        backend=str(args.backend),
        api=str(args.api),
        reshard_after_forward=args.reshard_after_forward,
        explicit_prefetch=args.explicit_prefetch,
    )
    return prediction, loaded


def _model_main(args: argparse.Namespace) -> int:
    from fsdp_shell.predict.model import predict_time
    from fsdp_shell.predict.report import format_prediction, format_step_time, prediction_to_json, step_time_to_json

    try:
        prediction, loaded = predict_from_args(args)
        cost = CostModel(
            intra_node_bandwidth=args.intra_node_gbps * 1e9, inter_node_bandwidth=args.inter_node_gbps * 1e9
        )
        time = predict_time(
            prediction, flops_per_second=args.tflops * 1e12, cost=cost, ranks_per_node=args.ranks_per_node
        )
    except (ValueError, TypeError) as exc:
        print(f"fsdp-plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = prediction_to_json(prediction, model=loaded.name, inputs=loaded.inputs)
        out["step_time"] = step_time_to_json(prediction, time)
        print(json.dumps(out, indent=2))
    else:
        print(format_prediction(prediction, model=loaded.name, inputs=loaded.inputs))
        print()
        print(format_step_time(prediction, time))
    return 0


@console_script("fsdp-plan")
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fsdp-plan``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is not None:
        return _model_main(args)
    try:
        if args.backward_ms < 0:
            raise ValueError(f"--backward-ms: expected >= 0, got {args.backward_ms}")
        plan = plan_from_args(args)
        schedule = unshard_from_args(args, plan)
    except (ValueError, TypeError) as exc:
        print(f"fsdp-plan: error: {exc}", file=sys.stderr)
        return 2
    problems = check_plan(plan)
    unshard_problems = [] if schedule is None else check_unshard(schedule)
    timeline = simulate_timeline(plan, units=args.units, backward_seconds=args.backward_ms / 1e3, unshard=schedule)
    if args.json:
        out = plan_to_json(plan, problems)
        out["unshard"] = None if schedule is None else unshard_to_json(schedule, unshard_problems)
        gather = all_gather_volume(plan.request)
        out["all_gather_bytes"] = None if gather is None else gather.bytes
        out["memory"] = _memory_json(plan, _executor(args))
        out["timeline"] = timeline_to_json(timeline)
        print(json.dumps(out, indent=2))
    else:
        memory = _memory_table(plan, _executor(args))
        parts = [format_plan(plan), _comm_table(plan), _verdict("verifier", problems), memory]
        if schedule is not None:
            parts += [format_unshard(schedule), _verdict("all-gather schedule", unshard_problems)]
        parts.append(f"{format_timeline(timeline)}\n{describe_cost(CostModel())}")
        print("\n\n".join(parts))
    return 1 if problems or unshard_problems else 0


if __name__ == "__main__":
    sys.exit(main())
