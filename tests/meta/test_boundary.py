"""The one-way boundaries: fsdp_core imports no torch.distributed, torch.cuda or shell code;
tests and benchmarks never import each other (what both need is the library's)."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "fsdp_core"
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
            assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), (
                f"{path.relative_to(CORE)} imports {name}"
            )


def test_importing_core_loads_no_shell_module() -> None:
    code = "import sys, fsdp_core; print(sorted(m for m in sys.modules if m.startswith('fsdp_shell')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_clis_that_need_no_process_group_load_no_training_runtime() -> None:
    """``fsdp-plan`` and ``fsdp-sim`` load no ``torch.distributed`` module beyond what ``import
    torch`` itself loads, and no shell module outside ``fsdp_shell.cli``."""
    code = (
        "import sys, torch\n"
        "before = {m for m in sys.modules if m.startswith('torch.distributed')}\n"
        "import fsdp_shell.cli.plan, fsdp_shell.cli.sim\n"
        "extra = sorted(m for m in sys.modules if m.startswith('torch.distributed') and m not in before)\n"
        "shell = sorted(m for m in sys.modules if m.startswith('fsdp_shell') and not m.startswith('fsdp_shell.cli'))\n"
        "print(extra, shell)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[] ['fsdp_shell']"


def test_fsdp_plan_model_loads_no_wrapper_hooks_or_runtime() -> None:
    """``fsdp-plan --model`` builds units with the wrapper's own code (``fsdp_shell.units.build``)
    and makes no process group: neither the wrapper, its hooks, its tree nor a runtime that runs
    plans is loaded. (Building a model under ``torch.device("meta")`` makes torch import some
    ``torch.distributed`` modules of its own.)"""
    code = (
        "import sys, io, contextlib, torch\n"
        "from fsdp_shell.cli.plan import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--model', 'demo', '--world-size', '2', '--batch-size', '1', '--seq', '8']) == 0\n"
        "print(torch.distributed.is_initialized(), sorted(m for m in sys.modules if m.startswith('fsdp_shell')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    initialized, shell = out.stdout.strip().split(" ", 1)
    assert initialized == "False"
    for module in ("fsdp", "hooks", "tree", "runtime.cpu", "runtime.accelerator", "runtime.interpreter"):
        assert f"'fsdp_shell.{module}'" not in shell, module
    assert "'fsdp_shell.units.build'" in shell and "'fsdp_shell.predict.trace'" in shell


def test_only_the_runtime_names_torch_cuda() -> None:
    """Every device-specific line of the library is in ``fsdp_shell/runtime/``, and none of it
    names CUDA: the accelerator runtime is written against torch's device-generic API, and the
    demo picks the backend and a device per rank through ``torch.accelerator``."""
    shell = CORE.parent / "fsdp_shell"
    outside = sorted(
        str(path.relative_to(shell))
        for path in shell.rglob("*.py")
        if "torch.cuda" in path.read_text() and path.relative_to(shell).parts[0] != "runtime"
    )
    assert outside == []
    runtime = sorted(p.name for p in (shell / "runtime").glob("*.py") if "torch.cuda" in p.read_text())
    assert runtime == []


def test_the_training_runtime_imports_no_model_of_itself() -> None:
    """Training loads neither the memory model nor the simulator: the runtime and the models call
    the same rules (``fsdp_core.execution``); the runtime does not ask a model of itself."""
    code = (
        "import sys\n"
        "import fsdp_shell\n"
        "from fsdp_shell import FullyShardedDataParallel\n"
        "import fsdp_shell.runtime.cpu, fsdp_shell.runtime.accelerator, fsdp_shell.hooks, fsdp_shell.tree\n"
        "print(sorted(m for m in sys.modules if m.startswith(('fsdp_core.memory', 'fsdp_core.sim'))))\n"
        "print('fsdp_core.execution.lane' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["[]", "True"]


def crossings(source: str, other: str) -> list[str]:
    """Where ``source`` reaches into the top-level package ``other``: an import of it (in a
    function too), or a string that imports it (``python -c`` code) or names it as a path or a
    module (``ROOT / "benchmarks"``, ``"benchmarks/x.py"``, ``"tests.worlds.x"``)."""
    imports = re.compile(rf"\b(?:from|import)\s+{other}\b")
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # relative: inside its own package
            found += [(node.lineno, f"import {n}") for n in names if n == other or n.startswith(f"{other}.")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text == other or text.startswith((f"{other}/", f"{other}.")) or imports.search(text):
                found.append((node.lineno, f"string {text[:60]!r}"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_tests_and_benchmarks_never_import_each_other() -> None:
    """No module under ``tests/`` uses ``benchmarks``, and none under ``benchmarks/`` or
    ``scripts/`` uses ``tests`` (``crossings``): a benchmark is free to change what it measures
    and prints, and a test stands on the library alone. (The test command and the GPU check,
    ``scripts/*.sh``, run tests by design; only Python modules are checked, this one aside: it
    names both sides to check them.)"""
    sides = {"tests": ("benchmarks",), "benchmarks": ("tests",), "scripts": ("tests",)}
    bad: list[str] = []
    for folder, others in sides.items():
        files = sorted((ROOT / folder).rglob("*.py"))
        assert len(files) >= 2, folder
        for path in files:
            if path == pathlib.Path(__file__).resolve():
                continue
            source = path.read_text(encoding="utf-8")
            bad += [f"{path.relative_to(ROOT)} {hit}" for other in others for hit in crossings(source, other)]
    assert bad == []


def test_crossings_finds_every_way_in() -> None:
    code = """
import benchmarks
from benchmarks.bench_memory import CONFIGS
def f() -> None:
    import benchmarks.cluster
    run(["python", "-c", "from benchmarks.cluster import x; x()"], cwd=ROOT / "benchmarks")
    run([sys.executable, "benchmarks/gradient_path.py"])
    importlib.import_module("benchmarks.cluster")
"""
    assert [hit.split(":")[0] for hit in crossings(code, "benchmarks")] == [
        "line 2",
        "line 3",
        "line 5",
        "line 6",
        "line 6",
        "line 7",
        "line 8",
    ]
    fine = '''"""As ``python benchmarks/bench_memory.py`` prints it."""\nimport benchmarking, tests_helpers\n'''
    assert crossings(fine, "benchmarks") == [] and crossings(fine, "tests") == []
