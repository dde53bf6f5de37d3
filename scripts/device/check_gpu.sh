#!/usr/bin/env bash
# GPU correctness on the device machine, from the repository root: the gpu-marked tests (kernels, CUDA
# graphs with overlap), the kernel check/timing table, and the comparison with transformers on the
# random bf16 presets. Results under $OUT (kernels.json, check_hf.json, logs).
#   OUT=/path bash scripts/device/check_gpu.sh            MODELS="preset:qwen3-4b preset:nanbeige4.1-3b"
set -uo pipefail
MODELS=${MODELS:-"preset:qwen3-4b preset:nanbeige4.1-3b"}
source "$(dirname "$0")/env.sh"
status=0
python -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 || status=1
python scripts/device/kernels.py --quick 2>&1 | tee "$OUT/kernels.log" | tail -14 || status=1
args=()
for m in $MODELS; do args+=(--model "$m"); done
python scripts/device/check_hf.py "${args[@]}" 2>&1 | tee "$OUT/check_hf.log" | tail -12 || status=1
exit $status
