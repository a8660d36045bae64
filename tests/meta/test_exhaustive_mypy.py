"""mypy rejects a new op kind or schedule action wherever it is not handled.

The test copies ``fsdp_core`` and ``fsdp_shell`` into a temporary directory, adds a dummy kind to
the ``Op`` union (``Barrier``) and to the ``UnshardAction`` union (``Pause``), and runs mypy with
the project's configuration on the copy. Every consumer must then fail, at its ``assert_never``:
for ops, exactly the functions that ``match`` on a parameter annotated ``Op`` (found here from
the source, so a new consumer is covered without editing this file); for actions, the consumers
named below. Nothing else may fail. About 20 seconds without a mypy cache, a few with one.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BARRIER = '''@dataclass(frozen=True, slots=True, kw_only=True)
class Barrier:
    """A dummy op kind no consumer handles."""

    stream: Stream


Op = Union[
    Barrier,
'''
PAUSE = '''@dataclass(frozen=True, slots=True, kw_only=True)
class Pause:
    """A dummy action kind no consumer handles."""

    unit: int


UnshardAction = Union[Pause, '''

ACTION_CONSUMERS = {
    ("fsdp_core/unshard/schedule.py", "action_name"),
    ("fsdp_core/unshard/verifier.py", "act"),
    ("fsdp_core/sim/timeline.py", "hook_actions"),
    ("fsdp_shell/units/unshard.py", "run"),
    ("fsdp_shell/fsdp2/gathers.py", "run"),
    ("fsdp_core/sim/iteration.py", "hook"),
    ("fsdp_core/memory/unshard_memory.py", "run"),
}
"""Every consumer of ``UnshardAction``."""

OP_CONSUMERS_AT_LEAST = {
    ("fsdp_core/plan/ops.py", "op_name"),
    ("fsdp_core/plan/request.py", "buffers_of"),
    ("fsdp_core/plan/comm.py", "_volume"),
    ("fsdp_core/plan/render.py", "describe_op"),
    ("fsdp_core/plan/render.py", "_op_json"),
    ("fsdp_core/sim/timeline.py", "elementwise_bytes"),
    ("fsdp_core/sim/timeline.py", "run"),
    ("fsdp_core/plan/verifier.py", "step"),
    ("fsdp_shell/runtime/interpreter.py", "_step"),
    ("fsdp_core/memory/plan_memory.py", "step"),
}
"""The consumers of ``Op`` this change made exhaustive; the source may hold more."""


def _inject(path: Path, anchor: str, text: str) -> None:
    source = path.read_text()
    assert source.count(anchor) == 1, f"{path.name}: expected one {anchor!r}"
    path.write_text(source.replace(anchor, text))


def _functions_by_line(path: Path) -> list[tuple[int, int, str]]:
    tree = ast.parse(path.read_text())
    return [
        (node.lineno, node.end_lineno or node.lineno, node.name)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def _innermost(path: Path, line: int) -> str:
    around = [(start, name) for start, end, name in _functions_by_line(path) if start <= line <= end]
    assert around, f"{path}:{line} is in no function"
    return max(around)[1]


def _op_matchers(root: Path) -> set[tuple[str, str]]:
    """Functions that ``match`` on one of their parameters annotated ``Op``."""
    out: set[tuple[str, str]] = set()
    for package in ("fsdp_core", "fsdp_shell"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.FunctionDef):
                    continue
                params = {
                    a.arg
                    for a in [*node.args.args, *node.args.kwonlyargs]
                    if a.annotation is not None and ast.unparse(a.annotation) == "Op"
                }
                if any(
                    isinstance(m, ast.Match) and isinstance(m.subject, ast.Name) and m.subject.id in params
                    for m in ast.walk(node)
                ):
                    out.add((path.relative_to(root).as_posix(), node.name))
    return out


@pytest.mark.slow
def test_mypy_rejects_an_unhandled_op_or_action_everywhere(tmp_path: Path) -> None:
    for name in ("fsdp_core", "fsdp_shell", "typestubs"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    cache = tmp_path / ".mypy_cache"
    if (ROOT / ".mypy_cache").is_dir():
        shutil.copytree(ROOT / ".mypy_cache", cache)  # a warm start; mypy re-checks what changed
    _inject(tmp_path / "fsdp_core" / "plan" / "ops.py", "Op = Union[\n", BARRIER)
    _inject(tmp_path / "fsdp_core" / "unshard" / "schedule.py", "UnshardAction = Union[", PAUSE)

    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary", "fsdp_core", "fsdp_shell"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = [line for line in done.stdout.splitlines() if ": error: " in line]
    assert done.returncode == 1 and errors, done.stdout + done.stderr
    found: dict[str, set[tuple[str, str]]] = {"Barrier": set(), "Pause": set()}
    for line in errors:
        m = re.fullmatch(
            r'(\S+?):(\d+): error: Argument 1 to "assert_never" has incompatible type '
            r'"(Barrier|Pause)"; expected "Never"  \[arg-type\]',
            line,
        )
        assert m is not None, f"an error other than an unhandled dummy kind:\n{line}"
        path, lineno, kind = m.group(1), int(m.group(2)), m.group(3)
        found[kind].add((path, _innermost(tmp_path / path, lineno)))

    matchers = _op_matchers(tmp_path)
    assert matchers >= OP_CONSUMERS_AT_LEAST
    assert found["Barrier"] == matchers
    assert found["Pause"] == ACTION_CONSUMERS
