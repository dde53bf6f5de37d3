#!/usr/bin/env bash
# GPU correctness on the device machine, from the repository root: the gpu-marked tests (kernels, CUDA
# graphs with overlap) and the comparison with transformers on the random bf16 presets. Results under
# $OUT (check_hf.json, logs).
# DTYPES: the compute dtypes of the comparison (float32: tokenmill and HF in float32 on the same
# bf16-valued weights); STAGES picks the parts.
#   OUT=/path bash scripts/device/check_gpu.sh            MODELS="preset:qwen3-4b preset:nanbeige4.1-3b"
#   STAGES="tests hf" DTYPES="bfloat16 float32"
set -uo pipefail
MODELS=${MODELS:-"preset:qwen3-4b preset:nanbeige4.1-3b"}
STAGES=${STAGES:-"tests hf"}
DTYPES=${DTYPES:-"bfloat16"}
source "$(dirname "$0")/env.sh"
status=0
args=()
for m in $MODELS; do args+=(--model "$m"); done
for stage in $STAGES; do
  case $stage in
    tests) python -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 || status=1 ;;
    hf)
      for d in $DTYPES; do
        python scripts/device/check_hf.py "${args[@]}" --dtype "$d" 2>&1 | tee "$OUT/check_hf_$d.log" \
          | grep '^|' || status=1
      done ;;
  esac
done
exit $status
