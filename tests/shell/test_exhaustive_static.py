"""Statically: every ``match`` in ``fsdp_core`` and ``fsdp_shell`` ends in ``case _:
assert_never(<its subject>)``, and no function dispatches on an op or action parameter with
``isinstance``, ``type`` or ``getattr``. (``tests/meta/test_exhaustive_mypy.py`` runs mypy itself
on a copy of the packages with a dummy kind added.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "fsdp_core").rglob("*.py"), *(ROOT / "fsdp_shell").rglob("*.py")])


# -- statically: every match ends in assert_never, no dispatch by isinstance --------------------


def _matches(tree: ast.AST) -> list[ast.Match]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Match)]


def _ends_in_assert_never(match: ast.Match) -> bool:
    last = match.cases[-1]
    if not (isinstance(last.pattern, ast.MatchAs) and last.pattern.pattern is None and last.pattern.name is None):
        return False
    if last.guard is not None or len(last.body) != 1 or not isinstance(last.body[0], ast.Expr):
        return False
    call = last.body[0].value
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "assert_never"
        and len(call.args) == 1
        and ast.dump(call.args[0]) == ast.dump(match.subject)
    )


def test_every_match_ends_in_assert_never() -> None:
    found = 0
    bad: list[str] = []
    for path in SOURCES:
        for match in _matches(ast.parse(path.read_text(), filename=str(path))):
            found += 1
            if not _ends_in_assert_never(match):
                bad.append(f"{path.relative_to(ROOT)}:{match.lineno}: match {ast.unparse(match.subject)}")
    assert found >= 30, "the walk finds the package's matches"
    assert bad == [], "every match must end in `case _: assert_never(<subject>)`:\n" + "\n".join(bad)


UNIONS = {"Op", "UnshardAction"}


def _dispatches_on_parameter(function: ast.FunctionDef) -> list[str]:
    params = {
        a.arg
        for a in [*function.args.args, *function.args.kwonlyargs]
        if a.annotation is not None and ast.unparse(a.annotation) in UNIONS
    }
    out: list[str] = []
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "type", "getattr")
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in params
        ):
            out.append(f"{function.name}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_dispatch_on_an_op_or_action_but_match() -> None:
    bad: list[str] = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                bad += [f"{path.relative_to(ROOT)}: {b}" for b in _dispatches_on_parameter(node)]
    assert bad == [], "dispatch on an op or action with match ... assert_never:\n" + "\n".join(bad)


def test_the_static_checks_catch_what_they_forbid() -> None:
    wildcard = ast.parse("match op:\n    case Input():\n        pass\n    case _:\n        return None\n")
    listed = ast.parse("match op:\n    case Input():\n        pass\n    case _:\n        assert_never(op)\n")
    other = ast.parse("match op:\n    case Input():\n        pass\n    case _:\n        assert_never(other)\n")
    assert [_ends_in_assert_never(m) for t in (wildcard, listed, other) for m in _matches(t)] == [False, True, False]
    ladder = ast.parse("def f(op: Op) -> int:\n    return 1 if isinstance(op, Input) else _N[type(op)]\n")
    function = ladder.body[0]
    assert isinstance(function, ast.FunctionDef) and len(_dispatches_on_parameter(function)) == 2
