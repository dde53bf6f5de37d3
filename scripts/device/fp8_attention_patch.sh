#!/usr/bin/env bash
# The FP8 attention patches in lab/ on a GPU, in one call, from the repository root (carry .whl for the
# default part: bash scripts/device/server_wheels.sh):
#   lab/fp8_decode_k_asm_one_stage.patch  the FP8-cache one-kernel decode widens K by `fused_ops.widen_e4m3`
#                                          too, at one software-pipelining stage (compiled for sm90 on the
#                                          CPU: 36,864 bytes of shared memory a program, 96 registers under
#                                          the cap, five programs an SM; K by the assembly at two stages
#                                          took 53,248 bytes, four programs, and lost)
#   lab/fp8_decode_one_stage.patch        the control: the shipped FP8 decode at one stage (22,528 bytes)
#   lab/fp8_mixed_k_asm.patch             K by the assembly in the mixed steps' kernels (paged_attention.py;
#                                          the decode rows' loop 466 -> 444 instructions, shared memory and
#                                          the prefill's loops unchanged)
# The machine's copy of the tree is disposable: the shipped src goes to .ab_old/src, each patch to
# .v<n>/src, and PATCH (default: the first) is applied to src in place for the engine parts. Parts
# (PARTS, in order):
#   tests      the attention kernels' and the FP8 cache's tests, the gpu-marked ones too (the kernel tests run on CUDA
#              where it is there), on each patched tree
#   attention  lab/kv_fp8_attention_bench.py --graph: shipped, each patch, shipped again, twice over (one
#              layer, us, each call timed in a CUDA graph)
#   sim        scripts/device/ab_mixed.sh PARTS=sim, FP8 weights and KV (the engine core at C 64 and 256),
#              shipped against PATCH
#   default    the default offline workload, bf16 and FP8 W+KV, with PATCH (issue 28's row)
#   OUT=/path [PARTS="tests attention sim default"] [PATCHES="lab/a.patch ..."] [PATCH=lab/...patch] \
#     [MODEL=qwen3-4b] \
#     bash scripts/device/fp8_attention_patch.sh
set -uo pipefail
PARTS=${PARTS:-"tests attention sim default"}
PATCHES=${PATCHES:-"lab/fp8_decode_k_asm_one_stage.patch lab/fp8_decode_one_stage.patch lab/fp8_mixed_k_asm.patch"}
PATCH=${PATCH:-lab/fp8_decode_k_asm_one_stage.patch}
MODEL=${MODEL:-qwen3-4b}
source "$(dirname "$0")/env.sh"
HEAD=$TOKENMILL_GIT_COMMIT
rm -rf .ab_old && mkdir -p .ab_old && cp -r src .ab_old/src
n=0; TREES=""
for p in $PATCHES; do
  n=$((n + 1)); rm -rf ".v$n" && mkdir -p ".v$n" && cp -r .ab_old/src ".v$n/src"
  (cd ".v$n" && patch -p1 -s < "../$p") || { echo "$p does not apply" >&2; exit 2; }
  TREES="$TREES $n:$p"
done
patch -p1 -s < "$PATCH" || { echo "$PATCH does not apply" >&2; exit 2; }
FAILED=0
base=${PYTHONPATH#"$PWD/src"}
for part in $PARTS; do
  t0=$SECONDS
  case $part in
    tests)
      for t in $TREES; do
        PYTHONPATH="$PWD/.v${t%%:*}/src$base" python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/kernels/test_kv_fp8_kernels.py \
          tests/kernels/test_decode_attention.py tests/kernels/test_paged_attention.py tests/test_kv_fp8.py \
          > "$OUT/patch-tests-${t%%:*}.log" 2>&1 || FAILED=1
        echo "${t#*:}: $(tail -1 "$OUT/patch-tests-${t%%:*}.log")"
      done ;;
    attention)
      for side in shipped $TREES shipped $TREES shipped; do
        tree=$PWD/.ab_old/src; label=shipped
        [ "$side" != shipped ] && { tree=$PWD/.v${side%%:*}/src; label=$(basename "${side#*:}" .patch); }
        PYTHONPATH="$tree$base" python lab/kv_fp8_attention_bench.py --graph --label "$label" >> "$OUT/patch-attention.md" \
          2> "$OUT/patch-attention-$label.log" || { FAILED=1; tail -5 "$OUT/patch-attention-$label.log"; }
      done
      cat "$OUT/patch-attention.md" ;;
    sim)
      OLD=$HEAD NEW="$HEAD+$(basename "$PATCH" .patch)" PARTS=sim LEVELS=64,256 PROFILE_LEVELS="" MODEL=$MODEL \
        ENGINE_ARGS="quantization=fp8 kv_cache_dtype=fp8" bash scripts/device/ab_mixed.sh 2>&1 | tail -12 ;;
    default)
      TOKENMILL_GIT_COMMIT="$HEAD+$(basename "$PATCH" .patch)" OUT=$OUT MODEL=$MODEL PARTS=default AWQ=0 \
        bash scripts/device/quant_targets.sh 2>&1 | grep -E "^\||^##" ;;
    *) echo "unknown part $part" >&2; FAILED=1 ;;
  esac
  echo "$part: $((SECONDS - t0)) s" >&2
done
exit $FAILED
