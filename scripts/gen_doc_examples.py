"""Keep the worked examples in ``docs/*.md`` true: regenerate them from the Python API, or check them.

A generated block sits between two marker comments and holds one fenced ``text`` block::

    <!-- plan:full_shard -->
    ```text
    ...what format_plan prints...
    ```
    <!-- /plan:full_shard -->

The marker's kind says what is printed for the example named after the colon:

- ``plan``: ``format_plan(plan)``, exactly;
- ``comm``: one line per collective from ``comm_volume(plan)`` (per-rank ring volume);
- ``problems``: ``check_plan(plan)``, one problem per line (``(sound)`` when there is none);
- ``timeline``: ``format_timeline(simulate_timeline(plan, ...))`` with the example's units (and
  all-gather schedule, if it has one);
- ``schedule``: ``format_unshard(schedule)`` for an all-gather schedule of ``SCHEDULES``;
- ``unshard_problems``: ``check_unshard(schedule)``, one problem per line (``(sound)`` when none);
- ``sim``: what ``fsdp-sim`` prints for a name of ``SIM_BLOCKS``: the seed table
  (``format_seed_table``), or one row's timeline (``format_seed_timeline``);
- ``cli``: what ``fsdp-plan`` prints for the command line of ``CLI_BLOCKS`` (a whole model's
  predicted memory, ``--model``), exactly.

Usage::

    python scripts/gen_doc_examples.py           # rewrite every stale block in place
    python scripts/gen_doc_examples.py --check   # exit 1 and name every stale block

Examples are built through ``fsdp_core``'s public API (and ``fsdp-plan``'s entry point for
``cli``); nothing here reads a plan from the documents. The parts, each its own module beside
this one: ``doc_examples_catalog.py`` (every named example, schedule, ``fsdp-sim`` output and
``fsdp-plan`` command line), ``doc_examples_broken.py`` (the verifier's broken variants),
``doc_examples_render.py`` (what each kind prints) and ``doc_examples_blocks.py`` (finding,
checking and rewriting the blocks). This script is the command line, and re-exports what
``tests/meta/test_docs.py`` uses.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.doc_examples_blocks import DOCS, regenerate, stale_blocks
from scripts.doc_examples_catalog import EXAMPLES, SCHEDULES, SIM_BLOCKS, Example, ScheduleExample
from scripts.doc_examples_render import render

__all__ = [
    "DOCS",
    "EXAMPLES",
    "SCHEDULES",
    "SIM_BLOCKS",
    "Example",
    "ScheduleExample",
    "main",
    "regenerate",
    "render",
    "stale_blocks",
]


def main(argv: Sequence[str] | None = None) -> int:
    """Regenerate (default) or ``--check`` the generated blocks; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any block is stale")
    parser.add_argument("--docs", type=Path, default=DOCS, help=f"directory of Markdown files (default {DOCS})")
    args = parser.parse_args(argv)
    docs: Path = args.docs
    if args.check:
        stale = stale_blocks(docs)
        for item in stale:
            print(f"stale: {item}")
        if stale:
            print("run: python scripts/gen_doc_examples.py", file=sys.stderr)
        return 1 if stale else 0
    for item in regenerate(docs):
        print(f"regenerated: {item}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
