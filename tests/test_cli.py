"""fsdp-plan: text and JSON output, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fsdp_shell.plan_cli import main

STRATEGIES = ["NO_SHARD", "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main([*argv, "--json"]) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_issue_example_hybrid_32_by_8(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--strategy", "HYBRID_SHARD", "--world-size", "32", "--shard-size", "8",
                   "--numel", "302000000", "--reduce-dtype", "bfloat16")
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


@pytest.mark.parametrize("options", [["--no-all-reduce"], ["--no-all-reduce", "--pending-partial"], ["--pending-partial"]])
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
        [sys.executable, "-m", "fsdp_shell.plan_cli", "--strategy", "NO_SHARD", "--world-size", "4", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [c["collective"] for c in out["comm"]] == ["all_reduce"]
    assert out["padded_numel"] == out["numel"] == 1001
