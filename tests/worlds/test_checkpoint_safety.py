"""Checkpoints survive a kill during the save and refuse damage with one line (``fsdp-demo``).

A save writes a new version beside the old one and points ``CURRENT`` at it last
(``fsdp_shell.state.checkpoint``). Here the demo is killed (SIGKILL to its whole process group) after
each stage of a save and at random moments; the next ``--resume`` must continue from the old
checkpoint or the new one: the first loss after the resume, which only the restored state
decides, bit-exact; the later ones to a relative 1e-6 (about one resume in a hundred rounds a later
loss differently in its last bit, seen in CI; the cause is not yet found). Then each kind of
damage is made to a copy and ``--resume`` must exit 1 with one line naming the file, leaving the
directory as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_shell.demo.train import DemoConfig, RunResult, run_rank
from fsdp_shell.state.checkpoint import CURRENT, KILL_AT_ENV, current_version
from tests.worlds.dist_harness import run_world

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--quiet", "--layers", "2", "--width", "32", "--batch-size", "4", "--eval-every", "100"]
BASE = DemoConfig(
    steps=6, batch_size=4, quiet=True, eval_every=100, model=dataclasses.replace(DemoConfig().model, layers=2, width=32)
)


def demo(*argv: str, env: dict[str, str] | None = None, kill_after: float | None = None) -> int:
    """Run fsdp-demo in a session of its own; optionally SIGKILL the session after a delay."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdp_shell.demo.cli", *argv],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        if kill_after is not None:
            try:
                proc.wait(timeout=kill_after)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


def resumed_losses(directory: Path) -> tuple[int, list[float]]:
    result: RunResult = run_world(2, run_rank, dataclasses.replace(BASE, resume=str(directory)), timeout=300)[0]
    return result.start_step, result.losses


def test_a_kill_at_any_point_of_a_save_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    old, new, target = tmp_path / "old", tmp_path / "new", tmp_path / "target"
    assert demo("--steps", "2", "--save", str(old), *QUICK) == 0
    assert demo("--steps", "4", "--save", str(new), *QUICK) == 0
    expected = {2: resumed_losses(old), 4: resumed_losses(new)}
    assert expected[2][0] == 2 and expected[4][0] == 4
    trials: list[tuple[str, dict[str, str], float | None]] = [
        (stage, {KILL_AT_ENV: stage}, None) for stage in ("shards", "manifest", "current")
    ]
    rng = random.Random(0)
    trials += [(f"random-{i}", {}, rng.uniform(1.0, 6.0)) for i in range(2)]
    outcomes = {}
    for name, env, delay in trials:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(old, target)
        code = demo("--steps", "4", "--save", str(target), *QUICK, env=env, kill_after=delay)
        start, losses = resumed_losses(target)
        assert start in expected, (name, code, start)
        want = expected[start][1]
        assert losses[0] == want[0], (name, code, start)
        assert losses == pytest.approx(want, rel=1e-6, abs=0.0), (name, code, start)
        outcomes[name] = start
    assert outcomes["shards"] == 2 and outcomes["manifest"] == 2 and outcomes["current"] == 4, outcomes


def _tree_digest(directory: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        h.update(str(p.relative_to(directory)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _shard(version: Path) -> Path:
    return sorted(version.glob("*.distcp"))[0]


def _truncate(version: Path) -> str:
    shard = _shard(version)
    shard.write_bytes(shard.read_bytes()[:100])
    return shard.name


def _delete(version: Path) -> str:
    shard = _shard(version)
    shard.unlink()
    return shard.name


def _flip(version: Path) -> str:
    shard = _shard(version)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard.name


def _garbage_metadata(version: Path) -> str:
    (version / ".metadata").write_bytes(b"not a pickle")
    return ".metadata"


def _corrupt_meta(version: Path) -> str:
    (version / "meta.json").write_text('{"step": ')
    return "meta.json"


def _corrupt_manifest(version: Path) -> str:
    (version / "manifest.json").write_text("[1, 2")
    return "manifest.json"


def _no_current(version: Path) -> str:
    (version.parent / CURRENT).unlink()
    return CURRENT


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    assert demo("--steps", "2", "--save", str(directory), *QUICK) == 0
    return directory


@pytest.mark.parametrize(
    "damage",
    [_truncate, _delete, _flip, _garbage_metadata, _corrupt_meta, _corrupt_manifest, _no_current],
    ids=lambda f: f.__name__.strip("_"),
)
def test_damage_is_one_line_naming_the_file_and_changes_nothing(tmp_path: Path, saved: Path, damage: object) -> None:
    assert callable(damage)
    directory = tmp_path / "ckpt"
    shutil.copytree(saved, directory)
    named = damage(current_version(directory))
    before = _tree_digest(directory)
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_shell.demo.cli", "--steps", "4", "--resume", str(directory), *QUICK],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("fsdp-demo: error: --resume:"), done.stderr
    assert named in done.stderr, done.stderr
    assert _tree_digest(directory) == before
