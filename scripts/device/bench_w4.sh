#!/usr/bin/env bash
# W4A16 kernels on one H200, from the repository root (about 5 minutes):
#   tests   the W4 kernel tests compiled on the GPU: the small cases in bfloat16 and the gpu-marked ones
#           (qwen3-4b shapes, a CUDA graph)
#   micro   each qwen3-4b product at M = 1, 4, 8, 16, 256: bf16 (GEMV / cuBLAS) against the W4 path
#           (GEMV up to 4 rows, dequantize + cuBLAS above; the dequantize alone against a bf16 copy),
#           us and GB/s, checked against the dequantized reference first ($OUT/w4_micro.json); W4_ROWS=1,4
#           picks the row counts, W4_SHAPES=all adds nanbeige4.1-3b's products
#   tiles   the W4 GEMV's tiles in the batch-1 decode graph of each W4_MODELS model, one product's tile varied
#           at a time (scripts/device/decode_tiles.py --weights awq -> $OUT/decode_tiles-awq-<model>.md)
#   decode  batch-1 ms/token of preset:qwen3-4b (W4_MODELS="qwen3-4b,nanbeige4.1-3b": each) bf16 and AWQ
#           4-bit g128 ($OUT/w4_decode.json)
# The summary table is printed last and saved as $OUT/SUMMARY-w4.md.
#   OUT=/path STAGES="tests micro decode" bash scripts/device/bench_w4.sh
set -uo pipefail
W4_MODELS=${W4_MODELS:-qwen3-4b}
STAGES=${STAGES:-"tests micro decode"}
source "$(dirname "$0")/env.sh"
status=0
for stage in $STAGES; do
  t0=$SECONDS
  case $stage in
    tests)
      python -m pytest -q -m "gpu or not gpu" tests/kernels/test_w4_kernels.py tests/kernels/test_w4_sm90.py 2>&1 | tee "$OUT/w4_gpu_tests.log" | tail -4
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    tiles)
      for model in ${W4_MODELS//,/ }; do
        python scripts/device/decode_tiles.py --model "$model" --weights awq --out "$OUT" \
          > "$OUT/w4_tiles_$model.log" 2>&1 || { status=1; tail -20 "$OUT/w4_tiles_$model.log"; }
        cat "$OUT/decode_tiles-awq-$model.md" 2>/dev/null
      done ;;
    micro|decode)
      python scripts/device/bench_w4.py "$stage" --out "$OUT" > "$OUT/w4_$stage.log" 2>&1 \
        || { status=1; tail -20 "$OUT/w4_$stage.log"; } ;;
  esac
  echo "stage $stage: $((SECONDS - t0)) s"
done
python scripts/device/bench_w4.py summary --out "$OUT"
{ echo; echo "commit $TOKENMILL_GIT_COMMIT, stages \"$STAGES\", exit $status"; } | tee -a "$OUT/SUMMARY-w4.md"
exit $status
