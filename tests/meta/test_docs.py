"""The documentation stays true: generated examples are current, every rule and op is documented.

``scripts/gen_doc_examples.py`` regenerates the plan tables, volumes, verifier findings and
timelines inside ``docs/*.md``; these tests run its check in-process, so a change to the planner
or the renderer that is not reflected in the documents fails here.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
import typing
from pathlib import Path
from typing import Protocol, cast

import pytest

from fsdp_core import Destination, InputRole, Op, Rule, Stream

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GENERATOR = ROOT / "scripts" / "gen_doc_examples.py"


class Generator(Protocol):
    """The part of ``scripts/gen_doc_examples.py`` the tests use."""

    def stale_blocks(self, docs: Path = ...) -> list[str]: ...

    def regenerate(self, docs: Path = ...) -> list[str]: ...

    def render(self, kind: str, name: str) -> str: ...


@pytest.fixture(scope="module")
def generator() -> Generator:
    spec = importlib.util.spec_from_file_location("gen_doc_examples", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return cast(Generator, module)


def read(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def test_generated_blocks_are_current(generator: Generator) -> None:
    stale = generator.stale_blocks(DOCS)
    assert stale == [], "stale or malformed blocks; run: python scripts/gen_doc_examples.py\n" + "\n".join(stale)


def test_every_example_document_has_generated_blocks() -> None:
    for name, kind in [("examples.md", "plan"), ("verifier.md", "problems"), ("plan-reference.md", "timeline")]:
        assert f"<!-- {kind}:" in read(name), f"{name} has no generated {kind} block"


def test_check_names_a_stale_table_and_regenerate_fixes_it(generator: Generator, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    examples = docs / "examples.md"
    shutil.copyfile(DOCS / "examples.md", examples)  # every block of every document: test_generated_blocks_are_current
    original = examples.read_text(encoding="utf-8")
    fresh = generator.render("plan", "full_shard")
    assert fresh in original
    examples.write_text(
        original.replace(fresh, fresh.replace("shard[126:float32]", "shard[125:float32]")), encoding="utf-8"
    )

    assert generator.stale_blocks(docs) == ["examples.md plan:full_shard"]
    assert generator.regenerate(docs) == ["examples.md plan:full_shard"]
    assert examples.read_text(encoding="utf-8") == original
    assert generator.stale_blocks(docs) == []


def test_check_reports_unknown_and_unpaired_markers(generator: Generator, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text(
        "<!-- plan:no_such_example -->\n```text\n```\n<!-- /plan:no_such_example -->\n", encoding="utf-8"
    )
    (docs / "b.md").write_text("<!-- plan:full_shard -->\n```text\n```\n", encoding="utf-8")
    found = generator.stale_blocks(docs)
    assert found[0] == "a.md plan:no_such_example: unknown example"
    assert found[1].startswith("b.md: markers without a partner: plan:full_shard")
    assert len(found) == 2


def test_every_verifier_rule_is_documented() -> None:
    text = read("verifier.md")
    missing = [rule.name for rule in Rule if f"### `{rule.name}`" not in text or f"`{rule.value}`" not in text]
    assert missing == []


def test_every_op_type_is_documented() -> None:
    text = read("plan-reference.md")
    op_types: tuple[type, ...] = typing.get_args(Op)
    assert len(op_types) == 18
    missing = [t.__name__ for t in op_types if f"### `{t.__name__}`" not in text]
    assert missing == []


def test_every_stream_destination_and_input_role_is_documented() -> None:
    text = read("plan-reference.md")
    values: list[str] = [m.value for m in Stream] + [m.value for m in Destination] + [m.value for m in InputRole]
    missing = [v for v in values if f"`{v}`" not in text]
    assert missing == []


def test_links_between_documents_resolve() -> None:
    documents = sorted(DOCS.glob("*.md"))
    assert {p.name for p in documents} >= {
        "index.md",
        "design.md",
        "descriptors.md",
        "plan-reference.md",
        "verifier.md",
        "examples.md",
    }
    index = read("index.md")
    for path in documents:
        if path.name != "index.md":
            assert f"]({path.name})" in index, f"index.md does not link {path.name}"
    anchors = {p.name: _anchors(p.read_text(encoding="utf-8")) for p in documents}
    for path in documents:
        for target, anchor in re.findall(r"\]\(([a-z-]+\.md)?(?:#([a-z0-9_-]+))?\)", path.read_text(encoding="utf-8")):
            name = target or path.name
            assert name in anchors, f"{path.name} links to missing {name}"
            if anchor:
                assert anchor in anchors[name], f"{path.name} links to missing anchor {name}#{anchor}"


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than ``-``/``_`` dropped, spaces to ``-``."""
    out: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE):
        out.add(re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-"))
    return out
