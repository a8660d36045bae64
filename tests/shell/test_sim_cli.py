"""fsdp-sim: the seed table, timelines, Perfetto traces, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_core.sim import format_seed_table, seed_calibration
from fsdp_shell.cli.sim import main


def test_prints_the_seed_table_and_a_timeline_per_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith(format_seed_table(seed_calibration()) + "\n")
    for head in ("fsdp: 1157.9 ms", "hsdp_sync: 640.0 ms", "hsdp_async: 597.0 ms", "hsdp_async_cross_nic: 556.0 ms"):
        assert head in out
    assert out.count("  compute       |") == 4


def test_row_and_width_select_the_timelines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--row", "hsdp_sync", "--row", "fsdp", "--width", "40"]) == 0
    out = capsys.readouterr().out
    assert out.count("  compute       |") == 2 and "hsdp_async: 597.0 ms per" not in out
    rows = [line for line in out.splitlines() if line.startswith("  compute       |")]
    assert all(len(line.split("|")[1]) == 40 for line in rows)


def test_no_timeline_and_other_link_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--no-timeline", "--concurrent-collectives", "--contention", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "|" not in out
    assert "one_collective_per_group=False" in out and "nothing refitted" in out
    assert "contention                  1.5" in out


def test_trace_writes_one_perfetto_file_per_row(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "traces" / "new"
    assert main(["--no-timeline", "--trace", str(target)]) == 0
    assert "traces: " in capsys.readouterr().out
    files = sorted(p.name for p in target.iterdir())
    assert files == ["fsdp.json", "hsdp_async.json", "hsdp_async_cross_nic.json", "hsdp_sync.json"]
    trace = json.loads((target / "hsdp_async.json").read_text(encoding="utf-8"))
    events = trace["traceEvents"]
    threads = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert threads == ["compute", "all_gather", "post_backward", "all_reduce"]
    ends = [e["ts"] + e["dur"] for e in events if e["ph"] == "X"]
    assert max(ends) == pytest.approx(597.0e3, rel=1e-3)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--width", "5"], "--width"),
        (["--width", "wide"], "--width"),
        (["--contention", "0.5"], "--contention"),
        (["--contention", "nan"], "--contention"),
        (["--row", "ddp"], "--row"),
        (["--schedule", "fsdp"], "unrecognized arguments"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fsdp-sim: error:") and fragment in err


def test_unwritable_trace_directory_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    assert main(["--no-timeline", "--trace", str(blocker)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fsdp-sim: error: --trace:")


def test_console_script_runs_as_a_process() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_shell.cli.sim", "--no-timeline"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("PyTorch PR 106080")


def _block(name: str) -> str:
    """The body of generated block ``sim:name`` of docs/async-hsdp.md, without its fence."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "async-hsdp.md").read_text(encoding="utf-8")
    body = text.split(f"<!-- sim:{name} -->\n", 1)[1].split(f"<!-- /sim:{name} -->", 1)[0]
    assert body.startswith("```text\n") and body.endswith("\n```\n")
    return body.removeprefix("```text\n").removesuffix("```\n")


def test_the_documented_numbers_are_what_fsdp_sim_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--no-timeline"]) == 0
    assert capsys.readouterr().out == _block("seed_table")
    assert main(["--no-timeline", "--concurrent-collectives", "--contention", "1.25"]) == 0
    assert capsys.readouterr().out == _block("concurrent_contention_1_25")
    assert main([]) == 0
    out = capsys.readouterr().out
    for key in ("fsdp", "hsdp_sync", "hsdp_async", "hsdp_async_cross_nic"):
        assert _block(f"timeline_{key}") in out
