"""The one-way boundary: fsdp_core imports no torch.distributed, torch.cuda or shell code."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

CORE = pathlib.Path(__file__).resolve().parent.parent / "fsdp_core"
FORBIDDEN = ("torch.distributed", "torch.cuda", "fsdp_shell", "os", "io", "socket", "subprocess", "threading")


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
    return names


def test_core_sources_import_nothing_forbidden() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 20 and (CORE / "plan" / "planner.py") in files
    for path in files:
        for name in imported_modules(path):
            assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), f"{path.relative_to(CORE)} imports {name}"


def test_importing_core_loads_no_shell_module() -> None:
    code = "import sys, fsdp_core; print(sorted(m for m in sys.modules if m.startswith('fsdp_shell')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
