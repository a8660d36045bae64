#!/usr/bin/env bash
# GPU check: the CUDA-stream and NCCL paths on one GPU (world size 1), in well under 5 minutes.
# Usage: bash scripts/gpu_check.sh   (installs the project if needed; prints pytest's summary)
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
python -m pip install --disable-pip-version-check -q -e ".[dev]" >/dev/null 2>&1 || true
timeout 280 python -m pytest -q -p no:cacheprovider tests/test_gpu.py "$@"
