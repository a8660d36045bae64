#!/usr/bin/env bash
# GPU check, for the day a GPU is lent (one is enough), in under 5 minutes; one summary line per part:
#   1. world size 1 on NCCL (tests/test_gpu.py): every strategy, prefetch, offload, in-collective
#      division, and the slow-side-stream stress;
#   2. max_memory_allocated against FSDP1 on the same model, and against the memory prediction
#      (fsdp_shell.predict, backend nccl) with the reserved peak beside it;
#   3. the sharded and hybrid paths with 2 and 4 ranks sharing device 0 over gloo, on real device
#      streams, also with one side stream slowed (tests/gpu_worlds.py; it first names the
#      collectives gloo lacks for device tensors).
# Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
python -m pip install --disable-pip-version-check -q -e ".[dev]" >/dev/null 2>&1 || true
status=0
line=$(timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "not peak and not predicted" 2>&1 | tail -1) || status=1
echo "world size 1, NCCL: ${line}"
line=$(timeout 60 python -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k peak 2>&1 | grep -E "max_memory_allocated|passed|failed|error" | tr '\n' ' ') || status=1
echo "memory against FSDP1: ${line}"
line=$(timeout 90 python -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k predicted 2>&1 | grep -E "predicted peak|passed|failed|error" | tr '\n' ' ') || status=1
echo "memory against the prediction: ${line}"
timeout 200 python -m tests.gpu_worlds || status=1
exit $status
