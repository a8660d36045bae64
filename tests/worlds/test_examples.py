"""The README's drop-in example runs and its loss falls."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.worlds.dist_harness import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_drop_in_example_trains() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "drop_in.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0] / 2, done.stdout
    assert "trained 6337 parameters" in done.stdout


def test_drop_in_example_runs_under_torchrun_with_the_launchers_ranks() -> None:
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
            str(free_port()),
            str(ROOT / "examples" / "drop_in.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("trained 6337 parameters") == 1, done.stdout


def test_readme_links_the_example() -> None:
    assert "(examples/drop_in.py)" in (ROOT / "README.md").read_text()
