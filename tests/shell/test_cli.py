"""fsdp-plan: text and JSON output, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_shell.cli.plan import main

STRATEGIES = ["NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main([*argv, "--json"]) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_issue_example_hybrid_32_by_8(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys,
        "--strategy",
        "HYBRID_SHARD",
        "--world-size",
        "32",
        "--shard-size",
        "8",
        "--numel",
        "302000000",
        "--reduce-dtype",
        "bfloat16",
    )
    assert out["problems"] == []
    comm = out["comm"]
    assert isinstance(comm, list)
    assert [(c["collective"], c["group"], c["input_numel"], c["output_numel"], c["dtype"]) for c in comm] == [
        ("reduce_scatter", "shard", 302_000_000, 37_750_000, "bfloat16"),
        ("all_reduce", "replicate", 37_750_000, 37_750_000, "bfloat16"),
    ]
    assert comm[0]["bytes"] == 7 * 37_750_000 * 2
    assert comm[1]["bytes"] == 2 * 3 * 9_437_500 * 2
    ops = out["ops"]
    assert isinstance(ops, list)
    assert all(set(op) >= {"op", "stream"} for op in ops)
    all_reduce = next(op for op in ops if op["op"] == "all_reduce")
    assert all_reduce["stream"] == "all_reduce"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--param-dtype", "bfloat16", "--reduce-dtype", "float32"],
        ["--param-dtype", "float16", "--keep-low-precision-grads"],
        ["--offload", "--accumulate"],
        ["--use-orig-params", "--numel", "100,7,33"],
        ["--comm-hook", "allreduce"],
        ["--comm-hook", "fp16_compress"],
        ["--comm-hook", "bf16_compress", "--use-orig-params"],
        ["--no-sync"],
        ["--no-sync", "--pending-unsharded", "--use-orig-params"],
        ["--pending-unsharded", "--accumulate"],
        ["--division", "in_collective", "--backend", "nccl", "--reduce-dtype", "bfloat16"],
        ["--division", "in_collective", "--backend", "gloo", "--param-dtype", "float16"],
        ["--divide-factor", "3"],
        ["--force-full-precision", "--param-dtype", "bfloat16"],
        ["--use-orig-params", "--offload", "--numel", "100,7,33"],
    ],
)
def test_every_strategy_and_option_gives_a_sound_plan(
    capsys: pytest.CaptureFixture[str], strategy: str, options: list[str]
) -> None:
    shard = ["--shard-size", "2"] if strategy.startswith("HYBRID") else []
    out = run_json(capsys, "--strategy", strategy, "--world-size", "6", *shard, "--numel", "1001", *options)
    assert out["problems"] == []
    comm = out["comm"]
    assert isinstance(comm, list)
    if "--no-sync" in options:
        assert comm == []
    else:
        assert len(comm) == (2 if strategy.startswith("HYBRID") else 1)


@pytest.mark.parametrize(
    "options", [["--no-all-reduce"], ["--no-all-reduce", "--pending-partial"], ["--pending-partial"]]
)
def test_hybrid_deferred_all_reduce(capsys: pytest.CaptureFixture[str], options: list[str]) -> None:
    out = run_json(capsys, "--strategy", "HYBRID_SHARD", "--world-size", "8", "--shard-size", "4", *options)
    assert out["problems"] == []
    comm = out["comm"]
    assert isinstance(comm, list)
    expected = ["reduce_scatter"] if "--no-all-reduce" in options else ["reduce_scatter", "all_reduce"]
    assert [c["collective"] for c in comm] == expected


def test_text_output_shows_plan_volume_verdict_and_timeline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--strategy", "FULL_SHARD", "--world-size", "8", "--numel", "1001"]) == 0
    text = capsys.readouterr().out
    assert "reduce_scatter" in text and "grad.padded[1008:float32] -> shard[126:float32]" in text
    assert "verifier: sound" in text
    assert "simulated timeline" in text
    assert "communication per rank" in text
    assert "assumed: intra-node 150 GB/s and inter-node 25 GB/s per rank" in text


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--strategy", "QUARTER_SHARD"], "sharding_strategy"),
        (["--strategy", "HYBRID_SHARD", "--world-size", "6", "--shard-size", "4"], "shard_size"),
        (["--strategy", "FULL_SHARD", "--world-size", "8", "--shard-size", "4"], "shard_size"),
        (["--strategy", "FULL_SHARD", "--no-all-reduce"], "requires_all_reduce"),
        (["--strategy", "NO_SHARD", "--comm-hook", "reduce_scatter"], "comm_hook"),
        (["--comm-hook", "fp8_compress"], "comm_hook"),
        (["--comm-hook", "fp16_compress", "--reduce-dtype", "bfloat16"], "comm_hook"),
        (["--comm-hook", "allreduce", "--divide-factor", "2"], "division.factor"),
        (["--rank", "9", "--world-size", "8"], "rank"),
        (["--divide-factor", "0"], "divide_factor"),
        (["--hybrid-all-reduce", "sync"], "hybrid_all_reduce"),
        (
            ["--strategy", "HYBRID_SHARD", "--world-size", "4", "--shard-size", "2", "--hybrid-all-reduce", "later"],
            "hybrid_all_reduce",
        ),
        (["--param-dtype", "int8"], "dtype"),
        (["--numel", "0"], "numel"),
        (["--world-size", "0"], "world-size"),
    ],
)
def test_invalid_combinations_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        code = main(argv)
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fsdp-plan: error:")
    assert fragment in err


def test_console_script_runs_as_a_process() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_shell.cli.plan", "--strategy", "NO_SHARD", "--world-size", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [c["collective"] for c in out["comm"]] == ["all_reduce"]
    assert out["padded_numel"] == out["numel"] == 1001


@pytest.mark.parametrize(
    "argv", [["fsdp_shell.cli.plan", "--units", "500"], ["fsdp_shell.cli.sim", "--width", "5000"]], ids=["plan", "sim"]
)
def test_a_closed_pipe_ends_the_output_quietly(argv: list[str]) -> None:
    """``fsdp-plan ... | head -1``: the reader goes away after one line of an output larger than
    the pipe's buffer; no traceback."""
    with subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=120)
    assert first.strip()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def _steps(out: dict[str, object]) -> list[tuple[str, int, list[str]]]:
    unshard = out["unshard"]
    assert isinstance(unshard, dict)
    return [(s["event"], s["unit"], [f"{a['action']} {a['unit']}" for a in s["actions"]]) for s in unshard["steps"]]


def test_units_show_the_all_gather_schedule_of_a_chain(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--units", "3", "--backward-ms", "1")
    unshard = out["unshard"]
    assert isinstance(unshard, dict)
    assert (unshard["root"], unshard["forward_order"], unshard["backward_order"]) == (0, [0, 1, 2], [0, 2, 1])
    assert unshard["backward_prefetch"] == "BACKWARD_PRE" and unshard["forward_prefetch"] is False
    assert unshard["problems"] == []
    assert _steps(out) == [
        ("pre_forward", 0, ["gather 0", "await 0"]),
        ("pre_forward", 1, ["gather 1", "await 1"]),
        ("post_forward", 1, ["reshard 1"]),
        ("pre_forward", 2, ["gather 2", "await 2"]),
        ("post_forward", 2, ["reshard 2"]),
        ("post_forward", 0, []),
        ("pre_backward", 0, ["gather 2"]),
        ("pre_backward", 2, ["await 2", "gather 1"]),
        ("post_backward", 2, []),
        ("pre_backward", 1, ["await 1"]),
        ("post_backward", 1, []),
        ("post_backward", 0, []),
    ]
    # 1001 fp32 elements over 8 ranks: 7 shards of 126 elements arrive at each rank.
    assert out["all_gather_bytes"] == 7 * 126 * 4
    timeline = out["timeline"]
    assert isinstance(timeline, list)
    gathers = [(e["unit"], e["stream"]) for e in timeline if e["op"] == "all_gather"]
    assert gathers == [(2, "all_gather"), (1, "all_gather")]


@pytest.mark.parametrize(
    ("options", "pre_backward_1", "post_backward_2"),
    [
        (["--backward-prefetch", "BACKWARD_POST"], ["await 1"], ["gather 1"]),
        (["--backward-prefetch", "backward_post"], ["await 1"], ["gather 1"]),
        (["--backward-prefetch", "none"], ["gather 1", "await 1"], []),
        (["--backward-prefetch", "None", "--forward-prefetch"], ["gather 1", "await 1"], []),
    ],
)
def test_backward_prefetch_options(
    capsys: pytest.CaptureFixture[str], options: list[str], pre_backward_1: list[str], post_backward_2: list[str]
) -> None:
    out = run_json(capsys, "--units", "3", *options)
    steps = {(event, unit): actions for event, unit, actions in _steps(out)}
    # Unit 2 follows the root, whose post-backward fires last: no mode prefetches it.
    assert steps[("pre_backward", 0)] == []
    assert steps[("pre_backward", 2)] == ["gather 2", "await 2"]
    assert steps[("pre_backward", 1)] == pre_backward_1
    assert steps[("post_backward", 2)] == post_backward_2
    forward_prefetch = "--forward-prefetch" in options
    assert steps[("pre_forward", 0)] == ["gather 0", "await 0", *(["gather 1"] if forward_prefetch else [])]


def test_zero2_units_stay_gathered_through_backward(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--strategy", "SHARD_GRAD_OP", "--units", "3", "--backward-ms", "1")
    assert all(actions == [] for event, _, actions in _steps(out) if event.endswith("backward"))
    timeline = out["timeline"]
    assert isinstance(timeline, list) and all(e["op"] != "all_gather" for e in timeline)


@pytest.mark.parametrize("argv", [["--units", "1"], ["--strategy", "NO_SHARD", "--units", "4"]])
def test_no_schedule_for_one_unit_or_no_shard(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    out = run_json(capsys, *argv)
    assert out["unshard"] is None


def test_text_output_shows_the_schedule_and_the_all_gathers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--units", "4", "--backward-ms", "0.01", "--numel", "8000000"]) == 0
    text = capsys.readouterr().out
    assert "all-gather schedule: 4 unit(s), root 0; backward_prefetch BACKWARD_PRE" in text
    assert "all-gather schedule: sound" in text
    assert "  all_gather    |G" in text
    assert "unit 3 op  - all_gather      all_gather" in text


@pytest.mark.parametrize("value", ["sideways", "pre", ""])
def test_bad_backward_prefetch_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], value: str) -> None:
    assert main(["--backward-prefetch", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fsdp-plan: error: backward_prefetch:")
    assert "BACKWARD_PRE, BACKWARD_POST" in err


def test_sync_hybrid_all_reduce_stays_on_the_post_backward_stream(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--strategy", "HYBRID_SHARD", "--world-size", "8", "--shard-size", "4"]
    for placement, stream in (("async", "all_reduce"), ("sync", "post_backward")):
        out = run_json(capsys, *base, "--hybrid-all-reduce", placement)
        assert out["problems"] == [] and out["hybrid_all_reduce"] == placement
        ops = out["ops"]
        assert isinstance(ops, list)
        (all_reduce,) = [op for op in ops if isinstance(op, dict) and op.get("op") == "all_reduce"]
        assert all_reduce["stream"] == stream


def test_the_memory_the_plan_holds_on_the_cpu_runtime_and_on_device_streams(capsys: pytest.CaptureFixture[str]) -> None:
    """The hybrid bf16 plan of ``tests/core/test_plan_memory.py``: on the CPU runtime its peak is the
    reduce-scatter's receive buffer on top of the fp32 gradient and shard; on device streams the
    fp32 cast is the peak; the JSON carries the same figures op by op."""
    argv = ["--strategy", "HYBRID_SHARD", "--world-size", "4", "--shard-size", "2", "--numel", "4160"]
    argv += ["--param-dtype", "bfloat16", "--reduce-dtype", "float32"]
    assert main([*argv, "--backend", "gloo"]) == 0
    text = capsys.readouterr().out
    assert "memory on the device, bytes since the plan's start, on the CPU runtime (gloo):" in text
    assert "  peak       +24,960 B (during op 7 reduce_scatter)" in text
    assert "  hook's end -8,320 B (0 B of it freed, returned at a later wait)" in text
    assert "found 8,320 B of gradients; frees the unsharded parameter (8,320 B); hands off 8,320 B" in text
    assert main(argv) == 0
    assert "  peak       +8,320 B (during op 3 cast)" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["executor"] == "streams" and memory["peak"] == 8320 and memory["peak_op"] == 3
    assert len(memory["after"]) == 16 and memory["after"][-1] == memory["end"] == -8320


def test_the_test_command_has_a_help_that_runs_nothing() -> None:
    """``bash scripts/test.sh --help`` says what it runs and how to run a part, and exits before
    installing, linting or testing anything (all of which would write to stderr or take minutes)."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "test.sh"
    done = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("usage: bash scripts/test.sh [--quick] [PYTEST_ARGS...]\n"), done.stdout
    assert "bash scripts/test.sh tests/worlds/test_demo.py -k check" in done.stdout
    for tier in ("core", "shell", "worlds", "device", "meta"):
        assert f"tests/{tier}" in done.stdout and (script.parents[1] / "tests" / tier / "__init__.py").is_file()


def test_a_fully_shard_unit_prints_its_per_parameter_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """``--api fully_shard``: 9x6 (uneven over 4: chunks of 3 rows, 18 elements), 9 (3) and 4x8 on
    dimension 1 (2 columns, 8): a slice of 29, a reduce-scatter input of 116, FSDP2's division."""
    argv = ["--api", "fully_shard", "--world-size", "4", "--shapes", "9x6,9,4x8:1", "--backend", "gloo"]
    out = run_json(capsys, *argv, "--param-dtype", "bf16", "--reduce-dtype", "fp32")
    assert (out["layout"], out["numel"], out["padded_numel"], out["shard_numel"]) == ("per_param", 95, 116, 29)
    ops = out["ops"]
    assert isinstance(ops, list) and [op["op"] for op in ops if op["op"] in ("copy_in", "reduce_scatter")] == [
        "copy_in",
        "reduce_scatter",
    ]
    assert out["problems"] == [] and out["factors"] == {
        "pre": 1.0,
        "post": 4.0,
        "reduce_scatter_op": "sum",
        "all_reduce_op": "sum",
        "total": 4.0,
    }
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "per-parameter unit: 95 elements in 3 parameter(s), padded 116, shard 29" in text
    assert "verifier: sound" in text


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--shapes", "4x4"], "--shapes: only --api fully_shard"),
        (["--api", "fully_shard", "--shapes", "4xa"], "expected shapes like 9x6,9"),
        (["--api", "fully_shard", "--strategy", "NO_SHARD"], "sharding.strategy: a per-parameter unit"),
        (["--api", "fully_shard", "--world-size", "4", "--shapes", "4x6:1"], "does not divide over 4"),
    ],
)
def test_fully_shard_refusals_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err
