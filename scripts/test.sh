#!/usr/bin/env bash
# The test command: install what the project needs (fast when already there), then lint and
# check the formatting with ruff, type-check everything (the packages, tests,
# benchmarks and scripts) with mypy --strict, run the tests under
# coverage.py (also in the spawned gloo ranks and the CLIs' subprocesses) and print the line
# coverage of fsdp_core and fsdp_shell with the lines no test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
-h | --help)
  cat <<'USAGE'
usage: bash scripts/test.sh [--quick] [PYTEST_ARGS...]

The project's test command (CI runs it on a fresh clone, with no arguments):
  1. pip install torch==2.13.0 (the CPU build) and this project with its dev and plot extras;
  2. ruff check, ruff format --check, mypy --strict;
  3. pytest under coverage.py (the gloo ranks and the CLIs' subprocesses too), then the line
     coverage of fsdp_core and fsdp_shell, and the 20 slowest tests.
--quick: the edit-test loop, well under 2 minutes: ruff, then the tiers that need no second
  process (tests/core: pure fsdp_core; tests/shell: the shell in one process), without
  installing, type-checking or coverage.
The tiers (each folder's __init__.py says what it holds): tests/core, tests/shell,
tests/worlds (real gloo worlds), tests/device (the accelerator runtime), tests/meta (the code base).
Hypothesis properties run a fixed, derandomized budget; FSDP_HYPOTHESIS=nightly gives each ten
times its examples, drawn at random (tests/budget.py).
The whole command takes 11-12 minutes on a 2-core machine (CI, 2026-12-05: 12 min 01 s and
11 min 17 s, pytest 11 min 24 s and 10 min 39 s; the same suite's pytest has varied by about
3 minutes from run to run); --quick well under a minute.
Arguments go to pytest, for example:
  bash scripts/test.sh tests/core/test_rounding.py
  bash scripts/test.sh tests/worlds/test_demo.py -k check
  bash scripts/test.sh --quick -k lane
USAGE
  exit 0
  ;;
--quick)
  shift
  python -m ruff check .
  exec python -m pytest -q tests/core tests/shell "$@"
  ;;
esac
python -m pip install --disable-pip-version-check -q torch==2.13.0
python -m pip install --disable-pip-version-check -q -e ".[dev,plot]"
python -m ruff check .
python -m ruff format --check .
python -m mypy
rm -rf .coverage-data && mkdir -p .coverage-data
export COVERAGE_FILE="$PWD/.coverage-data/coverage"
python -m coverage run -m pytest -q --durations=20 "$@"
python -m coverage combine -q
python -m coverage report
core=$(python -m coverage report --include='*/fsdp_core/*' --format=total)
shell=$(python -m coverage report --include='*/fsdp_shell/*' --format=total)
echo "line coverage: fsdp_core ${core}%, fsdp_shell ${shell}% (lines only a real device runs: docs/design.md)"
