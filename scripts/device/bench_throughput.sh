#!/usr/bin/env bash
# Offline throughput benchmark on the GPU machine. Run from the repository root:
#
#   OUT=/path/to/results bash scripts/device/bench_throughput.sh
#
# Stages (STAGES, space-separated; each model in MODELS goes through each stage):
#   full     tokenmill alone on the full default workload (NUM_PROMPTS requests, 100-1024 in / 100-1024 out)
#   ratios   RATIO_BACKENDS on the same first RATIO_SUBSET requests, one process per backend, for the ratios
#   latency  batch-1 decode: one request, 32 in / 256 out, ms per output token, for LATENCY_BACKENDS
# A device command is limited to about ten minutes, so split long runs over calls, e.g.
#   STAGES="full latency" bash scripts/device/bench_throughput.sh            (both models, tokenmill only)
#   STAGES=ratios MODELS=qwen3-4b bash scripts/device/bench_throughput.sh
#   STAGES=ratios MODELS=nanbeige4.1-3b RATIO_SUBSET=32 bash scripts/device/bench_throughput.sh
#   STAGES="full full" bash scripts/device/bench_throughput.sh    (twice: on a fresh machine, the first run
#                                                                   sees empty caches, the second warm ones)
# Each stage writes NAME.json (all metrics, command, commit, date, hardware) and NAME.md under $OUT, and
# the tables of this call are gathered in $OUT/SUMMARY.md and printed at the end.
set -uo pipefail

MODELS=${MODELS:-"qwen3-4b nanbeige4.1-3b"}
STAGES=${STAGES:-"full ratios latency"}
NUM_PROMPTS=${NUM_PROMPTS:-256}
INPUT_LEN_RANGE=${INPUT_LEN_RANGE:-100,1024}
OUTPUT_LEN_RANGE=${OUTPUT_LEN_RANGE:-100,1024}
RATIO_SUBSET=${RATIO_SUBSET:-64}
RATIO_BACKENDS=${RATIO_BACKENDS:-tokenmill,hf-static,hf-cb}
LATENCY_BACKENDS=${LATENCY_BACKENDS:-tokenmill,hf-static}
EXTRA_ARGS=${EXTRA_ARGS:-}          # passed to every run, e.g. "--enforce-eager" or "--max-num-seqs 128"

source "$(dirname "$0")/env.sh"

{
  date -Is
  echo "commit $TOKENMILL_GIT_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python -c "import triton; print('triton', triton.__version__)" 2>/dev/null || true
} | tee "$OUT/env.txt"

STAMP=$(date +%Y%m%d-%H%M%S)
SUMMARY="$OUT/SUMMARY.md"
FAILED=0

bench() {        # bench NAME ARGS...
  local name=$1; shift
  local n=2 base=$name
  while [ -f "$OUT/$name.json" ]; do name="$base-$n"; n=$((n + 1)); done   # a stage given twice
  echo "### $name" >&2
  local t0=$SECONDS
  # shellcheck disable=SC2086
  if python -m tokenmill.bench throughput --output-dir "$OUT" --name "$name" "$@" $EXTRA_ARGS; then
    echo "### $name done in $((SECONDS - t0)) s" >&2
  else
    echo "### $name FAILED (exit $?) after $((SECONDS - t0)) s" >&2
    FAILED=1
  fi
  [ -f "$OUT/$name.md" ] && { cat "$OUT/$name.md"; echo; } >> "$SUMMARY"
}

for model in $MODELS; do
  # Materialise the random-weight preset once, outside any timed run.
  t0=$SECONDS
  python -m tokenmill.bench prepare --model "preset:$model" || { echo "prepare $model failed" >&2; FAILED=1; continue; }
  echo "### prepared preset:$model in $((SECONDS - t0)) s" >&2
  for stage in $STAGES; do
    case $stage in
      full)
        bench "full-$model-$STAMP" --model "preset:$model" --backend tokenmill --dataset random \
          --num-prompts "$NUM_PROMPTS" --input-len-range "$INPUT_LEN_RANGE" --output-len-range "$OUTPUT_LEN_RANGE" --seed 0 ;;
      ratios)
        bench "ratios-$model-$STAMP" --model "preset:$model" --backend "$RATIO_BACKENDS" --dataset random \
          --num-prompts "$NUM_PROMPTS" --input-len-range "$INPUT_LEN_RANGE" --output-len-range "$OUTPUT_LEN_RANGE" --seed 0 \
          --subset "$RATIO_SUBSET" ;;
      latency)
        bench "latency-$model-$STAMP" --model "preset:$model" --backend "$LATENCY_BACKENDS" --dataset random \
          --num-prompts 1 --input-len-range 32 --output-len-range 256 --seed 0 --no-progress ;;
      *) echo "unknown stage $stage" >&2; FAILED=1 ;;
    esac
  done
done

echo
echo "==================== summary ($OUT/SUMMARY.md) ===================="
cat "$SUMMARY" 2>/dev/null || echo "(no results)"
exit $FAILED
