#!/usr/bin/env bash
# FP8 products of many rows on one H200, from the repository root (about 6 minutes):
#   tests  the FP8 product tests on the GPU (tests/kernels/test_fp8_gemm.py, gpu-marked and not): among them
#          block-scaled products at 300 rows, which take fp8_rows since 32f73df
#   block  block-scaled (128 x 128) products at 64-8,192 rows: fp8_block_gemm (its tiles) and fp8_rows
#          against the dequantized layer and bf16 (lab/fp8_mid_rows.py --block)
#   rows   the per-channel sweep: the shipped dispatch, _scaled_mm, fp8_rows tiles (lab/fp8_mid_rows.py), at
#          ROWS (128,192,256,384,512)
#   offline  preset:qwen3-4b written as Qwen's block-wise FP8 checkpoint (write_fp8_block.py), the default
#          offline workload on it with each tree of SIDES ("old new"; old: .ab_old/src, e.g. e390365's,
#          where block scales dequantized the layer above 192 rows: `git archive e390365 src | tar x -C
#          .ab_old`, its src/tokenmill/assets removed to fit the carry), and bf16 beside them
#   OUT=/path STAGES="tests block" bash scripts/device/fp8_mid_rows.sh
# Tables under $OUT (fp8_block_rows.md, fp8_mid_rows.md, offline.md), printed last; the logs and the
# benchmarks' JSON in $OUT/details.tgz (the device returns few files).
set -uo pipefail
STAGES=${STAGES:-"tests block"}
source "$(dirname "$0")/env.sh"
status=0
for stage in $STAGES; do
  t0=$SECONDS
  case $stage in
    tests) python -m pytest -q -m "gpu or not gpu" tests/kernels/test_fp8_gemm.py -p no:cacheprovider 2>&1 \
             | tee "$OUT/fp8_tests.log" | tail -3
           [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    block) python lab/fp8_mid_rows.py --block --rows 64,128,192,256,512,2048,8192 --out "$OUT" > "$OUT/block.log" 2>&1 \
             || { status=1; tail -20 "$OUT/block.log"; } ;;
    rows)  python lab/fp8_mid_rows.py --rows "${ROWS:-128,192,256,384,512}" --out "$OUT" > "$OUT/rows.log" 2>&1 \
             || { status=1; tail -20 "$OUT/rows.log"; } ;;
    offline)
      block=/tmp/tokenmill-fp8-block/qwen3-4b
      python scripts/device/write_fp8_block.py preset:qwen3-4b "$block" > "$OUT/write_block.log" 2>&1 \
        || { status=1; tail -20 "$OUT/write_block.log"; continue; }
      base=${PYTHONPATH#"$PWD/src"}
      # .ab_old may travel without the bundled model's files (the carry limit): this tree's serve for both
      [ -d .ab_old/src/tokenmill ] && [ ! -d .ab_old/src/tokenmill/assets ] && cp -r src/tokenmill/assets .ab_old/src/tokenmill/
      for side in bf16 ${SIDES:-old new}; do
        src=$PWD/src model=$block
        [ "$side" = old ] && src=$PWD/.ab_old/src
        [ "$side" = bf16 ] && model=preset:qwen3-4b
        PYTHONPATH="$src$base" python -m tokenmill.bench throughput --model "$model" --backend tokenmill \
          --dataset random --num-prompts 256 --input-len-range 100,1024 --output-len-range 100,1024 --seed 0 \
          --no-progress --output-dir "$OUT/offline" --name "$side" > "$OUT/offline-$side.log" 2>&1
        echo "offline $side: $(grep '^| tokenmill' "$OUT/offline/$side.md" 2>/dev/null || echo FAILED)" | tee -a "$OUT/offline.md"
      done ;;
  esac
  echo "stage $stage: $((SECONDS - t0)) s"
done
tar czf /tmp/fp8-mid-rows-details.tgz -C "$OUT" --exclude '*.md' . && find "$OUT" -type f ! -name '*.md' -delete \
  && mv /tmp/fp8-mid-rows-details.tgz "$OUT/details.tgz"
for f in fp8_block_rows.md fp8_mid_rows.md offline.md; do
  [ -f "$OUT/$f" ] && { echo; echo "## $f"; cat "$OUT/$f"; }
done
echo; echo "commit $TOKENMILL_GIT_COMMIT, stages \"$STAGES\", exit $status"
exit $status
