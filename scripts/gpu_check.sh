#!/usr/bin/env bash
# GPU check, for the day a GPU is lent (one is enough), in under 8 minutes; one summary line per part:
#   1. world size 1 on NCCL (tests/device/test_gpu.py): every strategy, prefetch, offload, in-collective
#      division, and the slow-side-stream stress; then fully_shard against a plain model and FSDP2;
#   2. max_memory_allocated against FSDP1 on the same model, and against the memory prediction
#      (fsdp_shell.predict, backend nccl) with the reserved peak beside it, for the FSDP1 API and
#      for fully_shard (PyTorch's FSDP2 measured beside);
#   3. the sharded and hybrid paths with 2 and 4 ranks sharing device 0 over gloo, on real device
#      streams, also with one side stream slowed, then fully_shard against PyTorch's fully_shard on
#      2 and 4 ranks (tests/device/gpu_worlds.py; it first names the collectives gloo lacks for
#      device tensors);
#   4. step time at world size 1 on the GPU, our FSDP1 API and fully_shard against PyTorch's FSDP1 and FSDP2,
#      on the wide and many-tiny-units models (benchmarks/bench_gpu_step.py; one line per model);
#   5. the CPU step-time prediction where ranks do not share cores: benchmarks/bench_step_time.py on
#      10 configurations, each world started twice, every rank's threads on cores of its own
#      (--pin all: 8 of the 16 cores per rank of 2, 4 per rank of 4); the goal: configuration
#      means within 10%.
# Each part's whole output (failures with their tracebacks) is kept in GPU_CHECK_LOGS (a new
# temporary folder unless set); the last line names it.
# Usage: bash scripts/gpu_check.sh            (PYTHON: the interpreter that holds torch, else python3)
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$(command -v python3 || command -v python)}
logs=${GPU_CHECK_LOGS:-$(mktemp -d)}
mkdir -p "$logs"
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())" || exit 1
"$py" -c "import fsdp_shell" 2>/dev/null || "$py" -m pip install --disable-pip-version-check -q -e ".[dev]" >"$logs/install.log" 2>&1
status=0
pytest_part() {  # name, timeout, pytest arguments...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$py" -m pytest -q -s -rA --tb=short -p no:cacheprovider tests/device/test_gpu.py "$@" >"$logs/$name.log" 2>&1
}
pytest_part nccl 150 -k "not peak and not predicted and not fully_shard" || status=1
echo "world size 1, NCCL: $(tail -1 "$logs/nccl.log")"
pytest_part fully_shard 90 -k "fully_shard and not predicted" || status=1
echo "fully_shard, world size 1, NCCL: $(grep -E "^fully_shard|passed|failed|error" "$logs/fully_shard.log" | tr '\n' ' ')"
pytest_part peak 60 -k peak || status=1
echo "memory against FSDP1: $(grep -E "max_memory_allocated|passed|failed|error" "$logs/peak.log" | tr '\n' ' ')"
pytest_part predicted 120 -k predicted || status=1
echo "memory against the prediction, both APIs: $(grep -E "predicted peak|passed|failed|error" "$logs/predicted.log" | tr '\n' ' ')"
timeout 270 "$py" -m tests.device.gpu_worlds 2>&1 | tee "$logs/worlds.log" || status=1
timeout 150 "$py" benchmarks/bench_gpu_step.py --device cuda --rounds 20 2>"$logs/step.err" | tee "$logs/step.log" || status=1
step_configs=mlp-full_shard,mlp-full_shard-bf16,mlp-shard_grad_op,mlp-hybrid_shard,mlp-full_shard-orig,mlp-no_shard,mlp-hybrid_shard_zero2-bf16,mlp-full_shard-sgd,demo-full_shard,demo-full_shard-bf16-orig
timeout 240 "$py" benchmarks/bench_step_time.py --configs "$step_configs" --repeat 2 --steps 10 --pin all >"$logs/step_time.log" 2>&1 || status=1
echo "step-time prediction, each rank on cores of its own (the core's model): $(grep -E "^(predicted / measured|within 10%|per configuration)" "$logs/step_time.log" | tail -3 | tr '\n' ' ')"
echo "whole output of each part: $logs"
exit $status
