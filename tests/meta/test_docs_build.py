"""The documentation builds without warnings, and every Python example in it runs.

1. ``mkdocs build --strict`` (``mkdocs.yml``: every page in the nav, links and anchors checked,
   the API reference rendered from docstrings by mkdocstrings) succeeds and logs no ``WARNING``.
2. Every ```` ```python ```` fenced block of ``docs/*.md`` and ``README.md`` is one test case,
   ``page.md:L<line of the opening fence>``. What happens to a block is decided, in this order, by:

   - ``<!-- not-run: REASON -->`` on the line before the fence (blank lines may separate them):
     skipped with REASON. Only for blocks that need GPUs, several nodes or ``torchrun``.
   - ``<!-- run: world1 -->``: run after ``torch.distributed`` has been initialised as a gloo
     world of one rank on a free loopback port, destroyed again after the block.
   - ``<!-- run: torchrun2 -->``: a complete script, run as written on two ranks under
     ``torchrun`` (``python -m torch.distributed.run --nproc-per-node 2``); it passes when every
     rank exits with status 0. ``<!-- run: torchrun2 gloo-exit-abort -->`` (PyTorch's own FSDP1,
     shown for comparison) also passes when a rank's only failure is the abort of torch's gloo
     at interpreter exit (``terminate called without an active exception``, no traceback): the
     script itself ran to its end.
   - a block whose text occurs verbatim in a file ``examples/*.py`` is an excerpt of that example,
     which ``tests/worlds/test_examples.py`` runs whole: skipped, naming the file.
   - a block that imports nothing and binds only names that one module of ``fsdp_core`` or
     ``fsdp_shell`` also defines at top level is a *sketch* of that module's source (``design.md``
     shows the planner's ``Draft`` and ``PLAN_BUILDERS`` that way). It is not run: it must
     compile, and every name it reads must be bound by the block itself, be a builtin, a
     top-level name of that module, a member of an enum there, or an importable module, so a
     sketch cannot name what the code no longer has.
   - any other block is a complete program.

   A block is run as ``__main__`` from a file of its own (so ``multiprocessing`` spawn works; a
   block that needs several ranks spawns them itself, as ``examples/drop_in.py`` does), padded
   so that tracebacks carry the document's line numbers, in a fresh interpreter with the
   repository root as working directory, ``OMP_NUM_THREADS=1`` and a 120 s timeout. It passes
   when it exits with status 0.
3. Every page in ``docs/`` is in the ``nav`` of ``mkdocs.yml``, and every nav entry exists.
"""

from __future__ import annotations

import ast
import builtins
import enum
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import pytest
from mkdocs.config import load_config

from fsdp_shell.cli.launch import free_port, world_context

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = (*sorted(DOCS.glob("*.md")), ROOT / "README.md")
PACKAGES = ("fsdp_core", "fsdp_shell")

FENCE = re.compile(r"^(?P<indent> *)```python\s*$")
DIRECTIVE = re.compile(r"^<!--\s*(?P<kind>not-run|run):\s*(?P<arg>.*?)\s*-->$")

# Runs one block file as __main__, inside a world of one gloo rank when asked (port 0: the store
# binds a free loopback port itself). ``gc.collect()`` frees what the block left in reference
# cycles (FSDP modules hold the group), so that the group and its gloo threads are gone before
# the interpreter shuts down; see "The drop-in" in docs/user-guide.md.
RUNNER = """\
import gc, runpy, sys
path, world1 = sys.argv[1], sys.argv[2] == "world1"
if world1:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
try:
    runpy.run_path(path, run_name="__main__")
finally:
    gc.collect()
    if world1 and dist.is_initialized():
        dist.destroy_process_group()
"""

Mode = Literal["run", "world1", "torchrun2", "not-run", "excerpt", "sketch"]
RUN_DIRECTIVES = ("world1", "torchrun2", "torchrun2 gloo-exit-abort")
GLOO_EXIT_ABORT = "terminate called without an active exception"


@dataclass(frozen=True, slots=True)
class Block:
    """One ```` ```python ```` block: where it is, its text, and what the test does with it."""

    page: Path
    line: int
    """1-based line of the opening fence; the code starts on the next line."""
    code: str
    mode: Mode
    detail: str
    """The reason (not-run), the example file (excerpt) or the module (sketch); else empty."""

    @property
    def id(self) -> str:
        return f"{self.page.name}:L{self.line}"


def parse_blocks(page: Path) -> list[Block]:
    """Every python block of ``page``, classified as the module docstring says."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent = fence.group("indent")
        end = i + 1
        while end < len(lines) and lines[end] != f"{indent}```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{page.name}:L{i + 1}: unclosed ```python block")
        code = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end]) + "\n"
        out.append(_classify(page, i + 1, code, _directive(lines, i, page)))
        i = end + 1
    return out


def _directive(lines: list[str], fence: int, page: Path) -> tuple[str, str] | None:
    before = fence - 1
    while before >= 0 and not lines[before].strip():
        before -= 1
    if before < 0:
        return None
    m = DIRECTIVE.match(lines[before].strip())
    if m is None:
        return None
    kind, arg = m.group("kind"), m.group("arg")
    if kind == "not-run" and not arg:
        raise ValueError(f"{page.name}:L{fence + 1}: <!-- not-run: REASON --> needs a reason")
    if kind == "run" and arg not in RUN_DIRECTIVES:
        raise ValueError(
            f"{page.name}:L{fence + 1}: unknown directive <!-- run: {arg} -->; accepted: {', '.join(RUN_DIRECTIVES)}"
        )
    return kind, arg


def _classify(page: Path, line: int, code: str, directive: tuple[str, str] | None) -> Block:
    if directive is not None:
        kind, arg = directive
        if kind == "not-run":
            return Block(page, line, code, "not-run", arg)
        if arg.startswith("torchrun2"):
            return Block(page, line, code, "torchrun2", arg.removeprefix("torchrun2").strip())
        return Block(page, line, code, "world1", "")
    for example in sorted((ROOT / "examples").glob("*.py")):
        if code.strip() in example.read_text(encoding="utf-8"):
            return Block(page, line, code, "excerpt", example.relative_to(ROOT).as_posix())
    module = _sketched_module(code)
    if module is not None:
        return Block(page, line, code, "sketch", module)
    return Block(page, line, code, "run", "")


def _top_level_bindings(tree: ast.Module) -> set[str]:
    """Names a module's own statements define at top level (imports excluded)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


@cache
def _package_definitions() -> dict[str, frozenset[str]]:
    """Module name -> the names it defines at top level, for every module of our packages."""
    out: dict[str, frozenset[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = frozenset(_top_level_bindings(ast.parse(path.read_text(encoding="utf-8"))))
    return out


def _sketched_module(code: str) -> str | None:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None  # a complete program that does not parse: running it reports the error
    if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree)):
        return None
    bound = _top_level_bindings(tree)
    if not bound:
        return None
    for module, defined in _package_definitions().items():
        if bound <= defined:
            return module
    return None


def _unresolved_names(code: str, module_name: str) -> list[str]:
    """Names the sketch reads that neither it, builtins, nor ``module_name`` provide."""
    tree = ast.parse(code)
    namespace = vars(importlib.import_module(module_name))
    available = set(namespace) | set(dir(builtins))
    for value in namespace.values():
        if isinstance(value, type) and issubclass(value, enum.Enum):
            available |= set(value.__members__)
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        if isinstance(node, ast.arg):
            bound.add(node.arg)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(n for n in read - bound - available if importlib.util.find_spec(n) is None)


BLOCKS = [block for page in PAGES for block in parse_blocks(page)]


def test_strict_build_has_no_warnings(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output
    assert (tmp_path / "site" / "reference" / "index.html").is_file()


def test_every_page_is_in_the_nav() -> None:
    config = load_config(str(ROOT / "mkdocs.yml"))
    in_nav = set(_nav_files(config.nav))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - in_nav == set(), "pages missing from the nav of mkdocs.yml"
    assert in_nav - pages == set(), "nav entries without a page"


def _nav_files(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav] if nav.endswith(".md") else []
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in _nav_files(value)]
    if isinstance(nav, list):
        return [f for item in nav for f in _nav_files(item)]
    return []


def test_blocks_are_found() -> None:
    ids = {b.id for b in BLOCKS}
    assert len(ids) == len(BLOCKS)
    assert any(b.page.name == "user-guide.md" and b.mode == "run" for b in BLOCKS)
    assert any(b.mode == "world1" for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_code_block(block: Block, tmp_path: Path) -> None:
    if block.mode == "not-run":
        pytest.skip(f"not run: {block.detail}")
    if block.mode == "excerpt":
        pytest.skip(f"excerpt of {block.detail}, which tests/worlds/test_examples.py runs")
    if block.mode == "sketch":
        compile(block.code, block.id, "exec")
        assert _unresolved_names(block.code, block.detail) == [], f"sketch of {block.detail} names what it lacks"
        return
    path = tmp_path / f"{block.page.stem}_L{block.line}.py"
    path.write_text("\n" * block.line + block.code, encoding="utf-8")
    if block.mode == "torchrun2":
        _run_on_two_ranks(block, path, {**os.environ, "OMP_NUM_THREADS": "1"})
        return
    log = tmp_path / "output.txt"
    child = world_context().Process(target=_run_block, args=(str(path), block.mode, str(log)))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"{block.id} did not finish within 120 s:\n{log.read_text()}")
    assert child.exitcode == 0, f"{block.id} failed:\n{log.read_text()}"


def _run_block(path: str, mode: str, log: str) -> None:
    """A fresh process for one block (forked from the fork server that has imported torch and
    the library, ``launch.world_context``): in the repository, its output in ``log``, run by
    ``RUNNER`` as ``python -c RUNNER path mode`` would run it."""
    os.chdir(ROOT)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = ["-c", path, mode]
    exec(compile(RUNNER, "<runner>", "exec"), {"__name__": "__runner__"})  # the runner above


def _run_on_two_ranks(block: Block, path: Path, env: dict[str, str]) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    result = subprocess.run(
        [*launcher, "--master-port", str(free_port()), str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    output = f"{result.stdout}\n{result.stderr}"
    if result.returncode != 0 and block.detail == "gloo-exit-abort":
        # torch's gloo aborted at exit, and no line of the script is in any traceback: it ran to its end
        assert GLOO_EXIT_ABORT in output and f'File "{path}"' not in output, output
        return
    assert result.returncode == 0, f"{block.id} failed on two ranks:\n{output}"


def test_the_gradient_path_in_the_design_is_the_traced_one() -> None:
    """``docs/design.md``'s "One gradient" section quotes the traced path's size, ours and FSDP2's,
    and lists main steps: the counts are what ``scripts/gradient_path.py`` traces now (run as a
    process; like ``scripts/gen_doc_examples.py`` it makes what the documents quote, and tests
    use nothing of ``benchmarks/``), and every listed function is on the traced path, in the
    file the row names."""
    import json

    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gradient_path.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=ROOT,
    )
    traced = json.loads(out.stdout)
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text[text.index("## One gradient, from hook to optimizer") :]
    section = section[: section.index("\n## ", 1)]
    quoted = re.findall(r"\*\*(\d+) functions in (\d+) files\*\*", section)
    assert quoted == [
        (str(traced["ours"]["functions"]), str(traced["ours"]["files"])),
        (str(traced["fsdp2"]["functions"]), str(traced["fsdp2"]["files"])),
    ], quoted
    rows = re.findall(r"^\| \d+ \| `([\w.]+)\(.*?\)` \| `([\w/.]+)` \|", section, flags=re.M)
    assert len(rows) >= 10
    listed = set(traced["ours"]["listed"])
    for function, path in rows:
        assert f"{path}:{function}" in listed, f"{function} in {path} is not on the traced gradient path"
