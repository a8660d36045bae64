#!/usr/bin/env bash
# The test command: install what the project needs (fast when already there), then lint and
# check the formatting with ruff, type-check everything with mypy --strict and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --disable-pip-version-check -q torch==2.13.0
python -m pip install --disable-pip-version-check -q -e ".[dev,plot]"
python -m ruff check .
python -m ruff format --check .
python -m mypy
python -m pytest -q "$@"
