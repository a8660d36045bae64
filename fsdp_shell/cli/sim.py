"""``fsdp-sim``: PyTorch PR 106080's table ("Enable async all-reduce for HSDP"), simulated.

Prints the seed's four iteration times beside the simulated ones, which are fitted and which
predicted, the free parameters, and an ASCII timeline of one iteration per row
(``fsdp_core.sim.pr106080``, ``fsdp_core.sim.iteration``). ``--trace DIR`` also writes one Chrome/Perfetto
trace per row, ``DIR/<row>.json`` (open it in https://ui.perfetto.dev or chrome://tracing).
``--contention`` and ``--concurrent-collectives`` show how the rows move under other link
models; nothing is refitted. Exit status: 0; 2 for bad arguments or an unwritable ``--trace``
directory (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from fsdp_core.sim import (
    SEED_PARAMETERS,
    SEED_ROWS,
    SeedCalibration,
    format_seed_table,
    format_seed_timeline,
    iteration_to_trace,
    seed_calibration,
)
from fsdp_shell.cli.parser import OneLineErrorParser, console_script

__all__ = ["build_parser", "main", "write_traces"]

ROW_KEYS = tuple(row.key for row in SEED_ROWS)


def _width(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 20:
        raise argparse.ArgumentTypeError(f"expected at least 20 columns, got {value}")
    return value


def _contention(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 1 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``fsdp-sim``."""
    p = OneLineErrorParser(prog="fsdp-sim", description="Simulate PyTorch PR 106080's FSDP / HSDP iteration times.")
    p.add_argument(
        "--row",
        action="append",
        choices=ROW_KEYS,
        default=None,
        help="show (and trace) only this row's timeline; repeatable (default: every row)",
    )
    p.add_argument("--width", type=_width, default=100, help="columns of the ASCII timelines (default 100)")
    p.add_argument("--no-timeline", action="store_true", help="print the table only")
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="DIR",
        help="write a Chrome/Perfetto trace per row to DIR/<row>.json",
    )
    p.add_argument(
        "--contention",
        type=_contention,
        default=SEED_PARAMETERS.contention,
        help=f"link contention factor, >= 1 (default {SEED_PARAMETERS.contention:g}: ideal sharing)",
    )
    p.add_argument(
        "--concurrent-collectives",
        action="store_true",
        help="let one process group's collectives run at once and share links "
        "(default: one at a time, as ProcessGroupNCCL)",
    )
    return p


def write_traces(calibration: SeedCalibration, directory: Path, keys: Sequence[str]) -> list[Path]:
    """Write ``iteration_to_trace`` of each row named in ``keys`` to ``directory/<key>.json``;
    returns the paths. Raises ``OSError`` when the directory cannot be made or written."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for result in calibration.results:
        if result.row.key in keys:
            path = directory / f"{result.row.key}.json"
            trace = iteration_to_trace(result.timeline, name=f"fsdp-sim {result.row.key}: {result.row.label}")
            path.write_text(json.dumps(trace), encoding="utf-8")
            paths.append(path)
    return paths


@console_script("fsdp-sim")
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fsdp-sim``; returns the exit status."""
    args = build_parser().parse_args(argv)
    keys: tuple[str, ...] = tuple(args.row) if args.row else ROW_KEYS
    params = dataclasses.replace(SEED_PARAMETERS, contention=args.contention)
    calibration = seed_calibration(params, one_collective_per_group=not args.concurrent_collectives)
    parts = [format_seed_table(calibration)]
    if not args.no_timeline:
        parts += [format_seed_timeline(r, args.width) for r in calibration.results if r.row.key in keys]
    if args.trace is not None:
        try:
            paths = write_traces(calibration, args.trace, keys)
        except OSError as exc:
            print(
                f"fsdp-sim: error: --trace: cannot write to {str(args.trace)!r}: {exc.strerror or exc}", file=sys.stderr
            )
            return 2
        parts.append("traces: " + ", ".join(str(p) for p in paths))
    print("\n\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
