#!/usr/bin/env bash
# lab/fp8_decode_widen_asm.patch on a GPU, in one call, from the repository root (carry .whl for the
# default part: bash scripts/device/server_wheels.sh). The machine's copy of the tree is disposable: the
# shipped src is copied to .ab_old/src and the patch applied to src in place. Parts (PARTS, in order):
#   tests      the attention kernels' and the FP8 cache's tests on the GPU (the kernel tests run on CUDA
#              where it is there), on the patched tree
#   attention  lab/kv_fp8_attention_bench.py, shipped then patched then shipped again (one layer, us)
#   sim        scripts/device/ab_mixed.sh PARTS=sim, FP8 weights and KV (the engine core at C 64 and 256)
#   default    the default offline workload, bf16 and FP8 W+KV, on the patched tree (issue 28's row)
#   OUT=/path [PARTS="tests attention sim default"] [MODEL=qwen3-4b] bash scripts/device/fp8_attention_patch.sh
set -uo pipefail
PARTS=${PARTS:-"tests attention sim default"}
MODEL=${MODEL:-qwen3-4b}
source "$(dirname "$0")/env.sh"
HEAD=$TOKENMILL_GIT_COMMIT
rm -rf .ab_old && mkdir -p .ab_old && cp -r src .ab_old/src
patch -p1 -s < lab/fp8_decode_widen_asm.patch || { echo "the patch does not apply" >&2; exit 2; }
FAILED=0
base=${PYTHONPATH#"$PWD/src"}
for part in $PARTS; do
  t0=$SECONDS
  case $part in
    tests)
      python -m pytest -q -p no:cacheprovider tests/kernels/test_kv_fp8_kernels.py \
        tests/kernels/test_decode_attention.py tests/kernels/test_paged_attention.py tests/test_kv_fp8.py \
        > "$OUT/patch-tests.log" 2>&1 || FAILED=1
      tail -3 "$OUT/patch-tests.log" ;;
    attention)
      for side in shipped patched shipped; do
        tree=$PWD/src; [ $side = shipped ] && tree=$PWD/.ab_old/src
        PYTHONPATH="$tree$base" python lab/kv_fp8_attention_bench.py --label "$side" >> "$OUT/patch-attention.md" \
          2> "$OUT/patch-attention-$side.log" || { FAILED=1; tail -5 "$OUT/patch-attention-$side.log"; }
      done
      cat "$OUT/patch-attention.md" ;;
    sim)
      OLD=$HEAD NEW="$HEAD+patch" PARTS=sim LEVELS=64,256 PROFILE_LEVELS="" MODEL=$MODEL \
        ENGINE_ARGS="quantization=fp8 kv_cache_dtype=fp8" bash scripts/device/ab_mixed.sh 2>&1 | tail -12 ;;
    default)
      TOKENMILL_GIT_COMMIT="$HEAD+patch" OUT=$OUT MODEL=$MODEL PARTS=default AWQ=0 \
        bash scripts/device/quant_targets.sh 2>&1 | grep -E "^\||^##" ;;
    *) echo "unknown part $part" >&2; FAILED=1 ;;
  esac
  echo "$part: $((SECONDS - t0)) s" >&2
done
exit $FAILED
