#!/usr/bin/env bash
# The CUDA graph capture after a dead engine (scripts/device/fp8_at_load.sh: the FP8-at-load and Granite GPU
# tests build engines one after another in a process) and a dead engine's memory freed without a collection
# (tests/test_gpu_engine.py), then o_proj and down through cuBLASLt (`fp8_gemm.TENSORWISE_MAX_ROWS`) against
# `fp8_rows` (TENSORWISE_MAX_ROWS=0) in the engine's own decode graphs at 16-64 sequences of qwen3-4b, FP8
# weights and KV, each variant captured on the same static buffers (lab/fp8_rows_early_weights.py --variants).
#   OUT=/path bash scripts/device/fp8_narrow_rows.sh        # carry .whl; STAGES="capture rows" (default)
#   VARIANTS='shipped;TENSORWISE_MAX_ROWS=0' BATCHES=16,32,48,64 MODEL=preset:qwen3-4b MIXED=128
# STAGES=tests: the FP8 products' GPU tests (tests/kernels/test_fp8_gemm.py, test_kv_fp8_kernels.py)
set -uo pipefail
STAGES=${STAGES:-"capture rows"}
source "$(dirname "$0")/env.sh"
status=0
for stage in $STAGES; do
  t0=$SECONDS
  case $stage in
    capture) timeout 170 bash "$(dirname "$0")/fp8_at_load.sh" || status=1
             python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py -k freed 2>&1 \
               | tee "$OUT/freed.txt" | tail -3; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    tests) python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_gemm.py \
             tests/kernels/test_kv_fp8_kernels.py 2>&1 | tee "$OUT/fp8-gpu-tests.txt" | tail -3
           [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    rows) python lab/fp8_rows_early_weights.py --model "${MODEL:-preset:qwen3-4b}" --batches "${BATCHES:-16,32,48,64}" \
            --variants "${VARIANTS:-shipped;TENSORWISE_MAX_ROWS=0}" --turns 5 --mixed-tokens "${MIXED:-128}" \
            --out "$OUT" > "$OUT/rows.log" 2>&1 || { status=1; tail -20 "$OUT/rows.log"; } ;;
  esac
  echo "stage $stage: $((SECONDS - t0)) s"
done
[ -f "$OUT/fp8_rows_early_weights.md" ] && { echo; cat "$OUT/fp8_rows_early_weights.md"; }
echo; echo "commit $TOKENMILL_GIT_COMMIT, stages \"$STAGES\", exit $status"
exit $status
