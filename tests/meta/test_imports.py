"""The import graph of our packages has no cycle and points one way.

Every module of ``fsdp_core`` and ``fsdp_shell`` (subpackages included) is parsed; every import
statement in it counts, those under ``if TYPE_CHECKING:`` and inside functions too. ``from X
import Y`` is an edge to the module ``X.Y`` when there is one, else to ``X``. The graph must have
no cycle, and no edge may lead from ``fsdp_core`` to ``fsdp_shell``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fsdp_core", "fsdp_shell")


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_graph_is_found() -> None:
    graph = _edges(_modules())
    assert len(graph) >= 40
    assert "fsdp_shell.tree" in graph["fsdp_shell.hooks"]
    assert "fsdp_core.plan.request" in graph["fsdp_core.plan.planner"]
    assert "fsdp_shell.tree" in graph["fsdp_shell.safety.agreement"], "imports under TYPE_CHECKING count"


def test_no_import_cycle() -> None:
    cycle = _cycle(_edges(_modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_core_never_imports_the_shell() -> None:
    graph = _edges(_modules())
    arrows = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a.startswith("fsdp_core")
        for b in targets
        if b.startswith("fsdp_shell")
    ]
    assert arrows == []
