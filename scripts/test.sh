#!/usr/bin/env bash
# The test command: install what the project needs (fast when already there), then
# type-check everything with mypy --strict and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --disable-pip-version-check -q torch==2.13.0
python -m pip install --disable-pip-version-check -q -e ".[dev,plot]"
python -m mypy
python -m pytest -q "$@"
