#!/usr/bin/env bash
# FP8 weights on one H200, from the repository root (about 5-6 minutes):
#   tests   tests/test_fp8.py and tests/kernels/test_fp8_gemm.py with the gpu-marked tests (kernels compiled
#           on the GPU: every fp8_linear path on qwen3-4b shapes, the single-token FP8 products, an FP8
#           model under CUDA graphs)
#   products each qwen3-4b product at M = 1-64 rows, bf16 vs FP8 as shipped vs W8A8 (scripts/device/
#           fp8_products.py, about 1 minute)
#   bench   preset:qwen3-4b bf16, then --quantization fp8 (one process each): batch-1 decode ms/token and
#           the default offline workload's output tok/s (scripts/device/bench_fp8.py); then fp8 again with
#           the products stage's fastest single-token tiles where they beat the shipped ones
#           ($OUT/fp8_best_tiles.json)
# The summary table is printed last and saved as $OUT/SUMMARY-fp8.md, with the error lines of any failed
# test. Carry .whl/srv: tests/test_fp8.py (the CLI) and test_real_model, which the kernel tests import,
# need the server's packages (fastapi, uvicorn), installed from those wheels where the machine lacks them.
#   OUT=/path STAGES="tests products bench" bash scripts/device/bench_fp8.sh
set -uo pipefail
STAGES=${STAGES:-"tests products bench"}
source "$(dirname "$0")/env.sh"
SITE=${TMPDIR:-/tmp}/tokenmill-srv-site
python -c "import fastapi, uvicorn" 2>/dev/null || python -m pip install -q --no-index --no-deps --target "$SITE" .whl/srv/*.whl
export PYTHONPATH="$SITE:$PYTHONPATH"
python -c "import fastapi, uvicorn" || { echo "fastapi/uvicorn missing: carry .whl/srv" >&2; exit 2; }
status=0
: > "$OUT/SUMMARY-fp8.md"
for stage in $STAGES; do
  t0=$SECONDS
  case $stage in
    tests)
      python -m pytest -q -m "gpu or not gpu" tests/kernels/test_fp8_gemm.py tests/test_fp8.py 2>&1 \
        | tee "$OUT/fp8_gpu_tests.log" | tail -15
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      { echo "## tests (gpu included)"; echo; grep -E "passed|failed|error" "$OUT/fp8_gpu_tests.log" | tail -3
        grep -E "^FAILED|^ERROR" "$OUT/fp8_gpu_tests.log" | head -10
        # each failure's error lines (pytest's "E   ..." and the exception it ends on)
        if grep -qE "^(FAILED|ERROR)" "$OUT/fp8_gpu_tests.log"; then
          echo; echo '```'; grep -E "^E  |^[A-Za-z_.]*(Error|Exception):" "$OUT/fp8_gpu_tests.log" | head -40; echo '```'
        fi; echo; } >> "$OUT/SUMMARY-fp8.md" ;;
    products)
      python scripts/device/fp8_products.py --out "$OUT" > "$OUT/fp8_products.log" 2>&1 || status=1
      tail -40 "$OUT/fp8_products.log"
      { cat "$OUT/fp8_products.md" 2>/dev/null || { echo "products failed:"; tail -5 "$OUT/fp8_products.log"; }
        echo; } >> "$OUT/SUMMARY-fp8.md" ;;
    bench)
      for q in none fp8; do
        python scripts/device/bench_fp8.py run --quantization $q --out "$OUT" > "$OUT/fp8_bench_$q.log" 2>&1 \
          || { status=1; tail -20 "$OUT/fp8_bench_$q.log"; { echo "bench $q failed:"; tail -5 "$OUT/fp8_bench_$q.log"; } >> "$OUT/SUMMARY-fp8.md"; }
      done
      if [ -s "$OUT/fp8_best_tiles.json" ] && [ "$(cat "$OUT/fp8_best_tiles.json")" != "[]" ]; then
        python scripts/device/bench_fp8.py run --quantization fp8 --fp8-tiles "$OUT/fp8_best_tiles.json" --out "$OUT" \
          > "$OUT/fp8_bench_swept.log" 2>&1 || { status=1; tail -20 "$OUT/fp8_bench_swept.log"; }
      fi ;;
  esac
  echo "stage $stage: $((SECONDS - t0)) s"
done
echo
python scripts/device/bench_fp8.py summary --out "$OUT" > /dev/null
{ echo; echo "commit $TOKENMILL_GIT_COMMIT, stages \"$STAGES\", exit $status"; } >> "$OUT/SUMMARY-fp8.md"
cat "$OUT/SUMMARY-fp8.md"
exit $status
