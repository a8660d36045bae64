"""Documentation examples, the blocks in the documents: each generated block of ``docs/*.md``
(between ``<!-- kind:name -->`` and ``<!-- /kind:name -->``) compared with what
``scripts/doc_examples_render.py`` prints now, reported when stale or rewritten in place. Markers
that name nothing known, or have no partner, are reported and never rewritten.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from scripts.doc_examples_render import known, render

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
"""The directory whose ``*.md`` files hold generated blocks."""


_BLOCK = re.compile(
    r"<!-- (?P<kind>[a-z_]+):(?P<name>[a-z0-9_]+) -->\n(?P<body>.*?)<!-- /(?P=kind):(?P=name) -->",
    re.DOTALL,
)
_MARKER = re.compile(r"<!-- (/?)([a-z_]+):([a-z0-9_]+) -->")


@dataclass(frozen=True, slots=True)
class _Update:
    text: str
    """The document with every block regenerated."""
    stale: tuple[str, ...]
    """``file kind:name`` of every block whose body changed."""
    errors: tuple[str, ...]
    """Markers that name no example or kind, or have no partner."""


def _update(path: Path, text: str) -> _Update:
    stale: list[str] = []
    errors: list[str] = []
    paired = 0

    def fill(m: re.Match[str]) -> str:
        nonlocal paired
        paired += 1
        kind, name, body = m.group("kind"), m.group("name"), m.group("body")
        where = f"{path.name} {kind}:{name}"
        unknown = known(kind, name)
        if unknown is not None:
            errors.append(f"{where}: unknown {unknown}")
            return m.group(0)
        fresh = render(kind, name)
        if body != fresh:
            stale.append(where)
        return f"<!-- {kind}:{name} -->\n{fresh}<!-- /{kind}:{name} -->"

    new = _BLOCK.sub(fill, text)
    markers = _MARKER.findall(text)
    if len(markers) != 2 * paired:
        unpaired = sorted({f"{k}:{n}" for _, k, n in markers} - {f"{k}:{n}" for k, n, _ in _BLOCK.findall(text)})
        errors.append(f"{path.name}: markers without a partner: {', '.join(unpaired) or '(a name used twice?)'}")
    return _Update(text=new, stale=tuple(stale), errors=tuple(errors))


def _documents(docs: Path) -> list[Path]:
    return sorted(docs.glob("*.md"))


def stale_blocks(docs: Path = DOCS) -> list[str]:
    """Every generated block under ``docs`` that differs from what the API prints now, as
    ``"file kind:name"``, followed by every malformed marker; empty when all are current."""
    out: list[str] = []
    for path in _documents(docs):
        u = _update(path, path.read_text(encoding="utf-8"))
        out += [*u.stale, *u.errors]
    return out


def regenerate(docs: Path = DOCS) -> list[str]:
    """Rewrite every stale block under ``docs`` in place; return what changed (as ``stale_blocks``).

    Malformed markers are reported, never rewritten."""
    changed: list[str] = []
    for path in _documents(docs):
        old = path.read_text(encoding="utf-8")
        u = _update(path, old)
        if u.text != old:
            path.write_text(u.text, encoding="utf-8")
        changed += [*u.stale, *u.errors]
    return changed
