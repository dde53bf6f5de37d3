#!/usr/bin/env bash
# The one-kernel decode with a softmax of its own in each warp (lab/decode_warp_softmax.patch) against the
# shipped kernel, one layer of qwen3-4b's attention in CUDA graphs, both caches, in turns: shipped, patched,
# shipped, patched. The patched tree's kernel tests on CUDA first. From the repository root on the GPU
# machine; tables in $OUT/warp-softmax.md, test log in $OUT/warp-softmax-tests.log.
#   OUT=/path [CONFIGS=64x4x3x96,64x4x3x0,64x4x2x0] bash scripts/device/decode_warp_softmax.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
CONFIGS=${CONFIGS:-64x4x3x96,64x4x3x0,64x4x2x0}
rm -rf .ws && mkdir .ws && cp -r src .ws/src && (cd .ws && patch -p1 -s < ../lab/decode_warp_softmax.patch) \
  || { echo "the patch does not apply" >&2; exit 2; }
base=${PYTHONPATH#"$PWD/src"}
FAILED=0
PYTHONPATH="$PWD/.ws/src$base" python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider \
  tests/kernels/test_decode_attention.py tests/kernels/test_kv_fp8_kernels.py > "$OUT/warp-softmax-tests.log" 2>&1 || FAILED=1
echo "patched tree's tests: $(tail -1 "$OUT/warp-softmax-tests.log")"
for turn in 1 2; do
  PYTHONPATH="$PWD/src$base" python lab/attention_config_sweep.py --graph --label "shipped$turn" --configs 64x4x3x96 \
    2>&1 | grep "| decode" || FAILED=1
  PYTHONPATH="$PWD/.ws/src$base" python lab/attention_config_sweep.py --graph --label "warp$turn" --configs "$CONFIGS" \
    2>&1 | grep "| decode" || FAILED=1
done | tee "$OUT/warp-softmax.md"
exit $FAILED
