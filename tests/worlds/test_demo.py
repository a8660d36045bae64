"""fsdp-demo: the default run (short), --check, exact --save/--resume, other world sizes, bad arguments."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fsdp_core import CommHook, ShardingStrategy
from fsdp_shell.demo.check import CheckReport, StepCheck
from fsdp_shell.demo.cli import main as demo_main
from fsdp_shell.demo.model import ModelConfig
from fsdp_shell.demo.train import DemoConfig, RunResult, run_rank
from fsdp_shell.state.checkpoint import read_meta
from tests.worlds.dist_harness import free_port, run_world

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--quiet", "--layers", "2", "--width", "32", "--batch-size", "4"]


def demo(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_shell.demo.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


def summary_value(out: str, key: str) -> str:
    match = re.search(rf"^\s+{re.escape(key)}\s+(.*)$", out, re.MULTILINE)
    assert match is not None, out
    return match.group(1)


def test_default_run_trains_and_held_out_loss_falls() -> None:
    done = demo("--steps", "30", "--eval-every", "10", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    first, last = (float(x) for x in summary_value(done.stdout, "held-out loss").split(" -> "))
    assert last < first - 0.5, done.stdout
    assert "FULL_SHARD on 2 rank(s)" in done.stdout
    assert float(summary_value(done.stdout, "grad comm / step").split()[0]) > 0


def _traffic(rank: int, world: int, hooks: tuple[CommHook, ...]) -> dict[CommHook, float]:
    """Each hook's mean gradient traffic per step, as the demo's summary reports it."""
    out = {}
    for hook in hooks:
        cfg = DemoConfig(steps=2, batch_size=4, quiet=True, comm_hook=hook, model=ModelConfig(layers=2, width=32))
        out[hook] = statistics.mean(run_rank(rank, world, cfg).comm_bytes)
    return out


def test_every_hooks_traffic_is_counted_as_the_plans_count_it() -> None:
    """The demo's traffic (its summary's "grad comm / step", ``RunResult.comm_bytes``) for every
    ``--comm-hook``, as ``fsdp-plan`` counts each hook: the all-reduce hook sends twice a
    reduce-scatter's bytes on a ring, the compress hooks half (a 16-bit wire), the reduce-scatter
    hook what no hook sends. (That the summary prints it: ``test_default_run_trains_and_held_out_loss_falls``.)"""
    hooks = (CommHook.NONE, CommHook.ALLREDUCE, CommHook.REDUCE_SCATTER, CommHook.FP16_COMPRESS, CommHook.BF16_COMPRESS)
    comm = run_world(2, _traffic, hooks, timeout=300)[0]
    assert comm[CommHook.REDUCE_SCATTER] == comm[CommHook.NONE] > 0
    assert comm[CommHook.ALLREDUCE] == pytest.approx(2 * comm[CommHook.NONE], rel=0.01)
    half = comm[CommHook.NONE] / 2
    assert comm[CommHook.FP16_COMPRESS] == comm[CommHook.BF16_COMPRESS] == pytest.approx(half, rel=0.01)


def test_progress_bar_shows_loss_time_tokens_and_communication() -> None:
    done = demo("--steps", "3", *QUICK[1:])
    assert done.returncode == 0, done.stderr[-3000:]
    fields = ("loss=", "held_out=", "ms=", "tok_s=", "comm_MiB=")
    line = next(part for part in reversed(done.stderr.replace("\r", "\n").splitlines()) if "comm_MiB=" in part)
    assert all(field in line for field in fields), line
    assert [line.index(f) for f in fields] == sorted(line.index(f) for f in fields), f"loss first: {line}"


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--strategy", "SHARD_GRAD_OP", "--use-orig-params", "--grad-accum", "2", "--clip", "0.5"],
        ["--strategy", "NO_SHARD", "--comm-hook", "allreduce"],
        ["--strategy", "HYBRID_SHARD", "--nproc", "4", "--shard-size", "2", "--offload"],
        ["--mixed-precision", "bf16", "--comm-hook", "reduce_scatter"],
        ["--api", "fully_shard", "--strategy", "HYBRID_SHARD", "--nproc", "4", "--shard-size", "2", "--offload"],
        ["--api", "fully_shard", "--strategy", "SHARD_GRAD_OP", "--mixed-precision", "bf16", "--grad-accum", "3"],
        ["--api", "fully_shard", "--grad-accum", "2", "--clip", "0.5"],
    ],
    ids=[
        "full-shard",
        "grad-op-orig-accum-clip",
        "no-shard-hook",
        "hybrid-offload",
        "bf16-hook",
        "fully-shard-hybrid-offload",
        "fully-shard-grad-op-bf16-accum",
        "fully-shard-accum-clip",
    ],
)
def test_check_against_the_single_process_reference(options: list[str]) -> None:
    done = demo("--steps", "4", "--check", *QUICK, *options)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "OK" in summary_value(done.stdout, "check")


def _check_sabotaged(rank: int, world: int, cfg: DemoConfig) -> list[CheckReport]:
    """Two short ``--check`` runs, one with unit 0's reduced gradient and one with the updated
    parameters of unit 1 moved by one part in 2**20 before the check compares them (with
    ``fully_shard``: the first parameter's of each)."""
    reports = []
    for sabotage in ("gradients", "stepped"):
        original = getattr(StepCheck, sabotage)

        def sabotaged(
            self: StepCheck, original: Callable[[StepCheck], None] = original, sabotage: str = sabotage
        ) -> None:
            unit = 0 if sabotage == "gradients" else 1
            if self.states:
                group = self.states[unit].group
                assert group is not None
                p = group.sharded[0]
                moved = (p.grad if sabotage == "gradients" else p).to_local()  # type: ignore[union-attr]  # DTensors
            else:
                h = self.units[unit]
                moved = h.sharded_grad_flat() if sabotage == "gradients" else h.local
            assert moved is not None
            with torch.no_grad():
                moved.mul_(1 + 2.0**-20)
            original(self)

        setattr(StepCheck, sabotage, sabotaged)
        try:
            report = run_rank(rank, world, cfg).check
        finally:
            setattr(StepCheck, sabotage, original)
        if report is not None:
            reports.append(report)
    return reports


@pytest.mark.parametrize("api", ["fsdp1", "fully_shard"])
def test_check_fails_on_a_gradient_or_update_off_by_one_part_in_a_million(api: str) -> None:
    """A relative error of 2**-20 (8 float32 roundings of the value itself) is far outside the
    bound of a 2-rank float32 reduction (2 roundings of the terms)."""
    cfg = DemoConfig(
        api=api, steps=2, batch_size=4, quiet=True, eval_every=100, check=True, model=ModelConfig(layers=2, width=32)
    )
    grads, updates = run_world(2, _check_sabotaged, cfg, timeout=300)[0]
    assert not grads.passed and grads.gradients.ratio > 2 and grads.updates.ratio <= 1, grads.lines()
    # unit 0 and unit 1: FSDP1's first two blocks; fully_shard's root (the embedding first) and first block
    first, second = ("blocks.0.", "blocks.1.") if api == "fsdp1" else ("embed.", "blocks.0.")
    assert grads.gradients.name.startswith(first), grads.lines()
    assert not updates.passed and updates.updates.ratio > 2 and updates.gradients.ratio <= 1, updates.lines()
    assert updates.updates.name.startswith(second), updates.lines()


def documented_check_commands() -> list[str]:
    """Every ``fsdp-demo ... --check`` command line of the README and the documents."""
    found = []
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for line in page.read_text(encoding="utf-8").splitlines():
            command = line.split(" #")[0].strip()
            if command.startswith("fsdp-demo ") and "--check" in command.split():
                found.append(command)
    return found


def test_the_documents_show_check_commands() -> None:
    assert len(documented_check_commands()) >= 2


@pytest.mark.parametrize("command", documented_check_commands())
def test_documented_check_command_passes_as_written(command: str) -> None:
    """The command exactly as the documents show it (its step count included): the check holds
    at every step."""
    done = demo(*shlex.split(command)[1:], timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert summary_value(done.stdout, "check").endswith(": OK"), done.stdout


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_hugging_face_models_check_against_the_reference(model: str) -> None:
    pytest.importorskip("transformers")
    done = demo("--model", model, "--steps", "4", "--check", *QUICK, "--use-orig-params")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "OK" in summary_value(done.stdout, "check")


def test_gpt2_saved_flat_resumes_exactly_with_orig_params(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    base = DemoConfig(
        steps=6, batch_size=4, quiet=True, eval_every=100, model=ModelConfig(arch="gpt2", layers=2, width=32)
    )
    whole = _run(base, 2)
    _run(dataclasses.replace(base, steps=3, save=str(tmp_path)), 2)
    resumed = _run(dataclasses.replace(base, resume=str(tmp_path), use_orig_params=True), 2)
    assert resumed.start_step == 3
    assert resumed.losses == pytest.approx(whole.losses[3:], abs=1e-6)


def _run(cfg: DemoConfig, world: int) -> RunResult:
    return run_world(world, run_rank, cfg, timeout=600)[0]


@pytest.mark.parametrize(
    ("api", "use_orig_params"), [("fsdp1", False), ("fsdp1", True), ("fully_shard", False)], ids=str
)
def test_save_and_resume_continue_exactly(tmp_path: Path, api: str, use_orig_params: bool) -> None:
    base = DemoConfig(
        api=api,
        steps=6,
        batch_size=4,
        quiet=True,
        use_orig_params=use_orig_params,
        eval_every=100,
        strategy=ShardingStrategy.FULL_SHARD,
    )
    whole = _run(base, 2)
    _run(dataclasses.replace(base, steps=3, save=str(tmp_path)), 2)
    meta = read_meta(tmp_path)
    assert meta["step"] == 3
    resumed = _run(dataclasses.replace(base, resume=str(tmp_path)), 2)
    assert resumed.start_step == 3
    assert resumed.losses == pytest.approx(whole.losses[3:], abs=1e-6)


def test_resume_on_a_different_number_of_ranks(tmp_path: Path) -> None:
    base = DemoConfig(steps=8, batch_size=4, quiet=True, eval_every=100)
    first = _run(dataclasses.replace(base, steps=5, save=str(tmp_path)), 2)
    for world in (1, 3):
        resumed = _run(dataclasses.replace(base, resume=str(tmp_path)), world)
        assert resumed.world == world and resumed.start_step == 5
        assert resumed.losses[0] < first.losses[0] - 0.3, (first.losses, resumed.losses)


def test_profile_writes_a_trace_per_rank(tmp_path: Path) -> None:
    done = demo("--steps", "6", "--profile", str(tmp_path), *QUICK)
    assert done.returncode == 0, done.stderr[-3000:]
    traces = sorted(p.name for p in tmp_path.glob("trace_rank*.json"))
    assert traces == ["trace_rank0.json", "trace_rank1.json"]
    assert summary_value(done.stdout, "traces").startswith(f"{tmp_path}/trace_rank{{0..1}}.json (steps 3-5")
    trace = (tmp_path / "trace_rank0.json").read_text()
    assert "traceEvents" in trace[:2000]
    for step in ("forward unit 0", "backward unit 0", "gradient reduction unit 0", "end of backward unit"):
        assert f'"fsdp::{step}' in trace, step


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the plot extra is not installed")
def test_plot_writes_a_png_and_says_where(tmp_path: Path) -> None:
    """A name without a format gets ``.png`` (as matplotlib adds it), the summary names the file
    written, and a missing folder is made, as ``--save`` makes its own."""
    out = tmp_path / "new" / "curves"
    done = demo("--steps", "4", "--plot", str(out), *QUICK)
    assert done.returncode == 0, done.stderr[-3000:]
    written = out.with_name("curves.png")
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary_value(done.stdout, "plot") == str(written)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--strategy", "QUARTER_SHARD"], "--strategy"),
        (["--strategy", "HYBRID_SHARD", "--nproc", "6", "--shard-size", "4"], "--shard-size"),
        (["--strategy", "FULL_SHARD", "--shard-size", "2"], "--shard-size"),
        (["--nproc", "999"], "--nproc"),
        (["--nproc", "0"], "--nproc"),
        (["--steps", "0"], "--steps"),
        (
            ["--comm-hook", "fp8"],
            "--comm-hook: expected one of none, allreduce, reduce_scatter, fp16_compress, bf16_compress",
        ),
        (
            ["--comm-hook", "user"],
            "--comm-hook: expected one of none, allreduce, reduce_scatter, fp16_compress, bf16_compress",
        ),
        (["--strategy", "NO_SHARD", "--comm-hook", "reduce_scatter"], "--comm-hook"),
        (["--mixed-precision", "bf16", "--comm-hook", "fp16_compress"], "--comm-hook"),
        (["--mixed-precision", "int8"], "--mixed-precision"),
        (["--clip", "-1"], "--clip"),
        (["--width", "30"], "--width"),
        (["--resume", "/nonexistent/dir"], "--resume"),
        (["--check", "--resume", "/tmp"], "--check"),
        (["--lr", "-0.1"], "--lr"),
        (["--save", str(ROOT / "README.md" / "ckpt")], "--save"),
        (["--profile", str(ROOT / "README.md" / "traces")], "--profile"),
        (["--save", "/proc/fsdp-demo-checkpoint"], "--save: cannot write in /proc"),
        (["--plot", "out.txt"], "--plot: cannot write .txt files; accepted: "),
        (["--plot", str(ROOT)], f"--plot: {ROOT} is a directory; expected a file name such as {ROOT / 'loss.png'}"),
        (["--plot", str(ROOT / "README.md" / "loss.png")], "--plot: "),
        (["--api", "fully_shard", "--strategy", "NO_SHARD"], "--strategy: fully_shard shards; for NO_SHARD's"),
        (["--api", "fully_shard", "--use-orig-params"], "--use-orig-params: fully_shard's parameters are always"),
        (["--api", "fully_shard", "--comm-hook", "allreduce"], "--comm-hook: FSDP1's communication hooks;"),
        (["--api", "fsdp2"], "--api"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``fsdp-demo``'s entry point, called in this process: what its process prints and returns
    (one process below shows the console script's own exit status)."""
    try:
        status = demo_main(argv)
    except SystemExit as exit:  # argparse's own errors
        status = exit.code  # type: ignore[assignment]  # argparse exits with an int
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fsdp-demo: error:"), err
    assert fragment in err


def test_a_bad_argument_ends_the_process_with_status_2_and_one_line() -> None:
    done = demo("--steps", "0", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("fsdp-demo: error: --steps"), done.stderr


def test_runs_under_torchrun_with_the_launchers_ranks() -> None:
    port = str(free_port())
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "-m",
            "fsdp_shell.demo.cli",
            "--steps",
            "3",
            *QUICK,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("FULL_SHARD on 2 rank(s)") == 1, done.stdout


def test_checkpoint_from_a_different_model_is_refused(tmp_path: Path) -> None:
    saved = demo("--steps", "2", "--save", str(tmp_path), *QUICK)
    assert saved.returncode == 0, saved.stderr[-3000:]
    other = [*QUICK]
    other[other.index("--layers") + 1] = "3"
    done = demo("--steps", "4", "--resume", str(tmp_path), *other, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "different model: layers 3 here, 2 in the checkpoint" in done.stderr, done.stderr
    assert f"saved             {tmp_path} at step 2" in saved.stdout, saved.stdout
    resumed = demo("--steps", "3", "--resume", str(tmp_path), *QUICK, timeout=120)
    assert f"resumed from      {tmp_path} at step 2" in resumed.stdout, resumed.stdout


@pytest.mark.usefixtures("sigint_reaches_children")
@pytest.mark.parametrize("whole_group", [True, False], ids=["terminal", "parent-only"])
def test_ctrl_c_ends_with_one_line_status_130_and_no_process_left(whole_group: bool) -> None:
    """SIGINT as a terminal's Ctrl-C sends it (to the whole process group), and to the parent
    alone (which then interrupts its ranks): one line, exit status 130, no traceback, no
    leaked-semaphore warning, nothing of the session left running (an exited process that this
    container's init has not reaped yet does not count)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdp_shell.demo.cli", "--steps", "100000", "--layers", "1", "--eval-every", "1000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    assert proc.stderr is not None
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(lambda: proc.stderr.read(64), "")), daemon=True)  # type: ignore[union-attr]  # checked above
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while "step/s" not in "".join(seen) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert "step/s" in "".join(seen), "".join(seen)[-2000:]
        if whole_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        status = proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
        proc.stderr.close()
    err = "".join(seen)
    assert status == 130, err[-2000:]
    assert err.endswith("\nfsdp-demo: interrupted\n"), err[-2000:]
    assert "Traceback" not in err and "leaked" not in err, err[-2000:]
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-o", "stat=,args=", "-s", str(proc.pid)], capture_output=True, text=True, check=False)
    running = [line for line in ps.stdout.splitlines() if not line.lstrip().startswith("Z")]  # exited, unreaped
    assert running == [], ps.stdout
