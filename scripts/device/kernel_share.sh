#!/usr/bin/env bash
# Kernel time by kind (products, attention, other) over one offline workload, bf16 beside FP8 weights and
# FP8 weights + KV cache (lab/kernel_share.py under torch.profiler, each variant its own process), from the
# repository root:
#   OUT=/path MODEL=qwen3-4b [NUM=256] [LENS=100,1024] [VARIANTS="bf16 fp8w fp8wkv"] [NO_PDL=1] \
#     bash scripts/device/kernel_share.sh
# NO_PDL=1: kernels launched plainly, so that each one's profiled time is its own (lab/kernel_share.py).
# Prints each variant's kinds and top kernels; the tables are in $OUT/kernels-<model>-<variant>.json.
set -uo pipefail
MODEL=${MODEL:-qwen3-4b}
NUM=${NUM:-256}
LENS=${LENS:-100,1024}
VARIANTS=${VARIANTS:-"bf16 fp8w fp8wkv"}
source "$(dirname "$0")/env.sh"
FAILED=0
python -m tokenmill.bench prepare --model "preset:$MODEL" > "$OUT/prepare-$MODEL.log" 2>&1 || FAILED=1
for v in $VARIANTS; do
  case $v in
    bf16) extra="" ;;
    fp8w) extra="quantization=fp8" ;;
    fp8wkv) extra="quantization=fp8 kv_cache_dtype=fp8" ;;
    *) echo "unknown variant $v" >&2; FAILED=1; continue ;;
  esac
  t0=$SECONDS
  # shellcheck disable=SC2086
  python lab/kernel_share.py "preset:$MODEL" $extra --label "$MODEL-$v" --out "$OUT" --num-prompts "$NUM" \
    --len-range "$LENS" ${NO_PDL:+--no-pdl} > "$OUT/kernels-$MODEL-$v.log" 2>&1 || { FAILED=1; tail -5 "$OUT/kernels-$MODEL-$v.log" >&2; }
  echo "$v: $((SECONDS - t0)) s" >&2
done
for v in $VARIANTS; do grep -v "^\[" "$OUT/kernels-$MODEL-$v.log" | tail -17; echo; done
exit $FAILED
