#!/usr/bin/env bash
# KV memory study on the GPU machine (`tokenmill bench memory`): the paged cache's measured peak against a
# static per-request cache for 10 concurrent requests of 500-2,000 tokens, 32 mixed requests of 50-8,000
# tokens and 8 requests of 8,192 tokens, and the maximum concurrency, measured on this GPU and computed for
# a 24 GiB one. Run from the repository root:
#
#   OUT=/path/to/results bash scripts/device/bench_memory.sh
#
# env: MODELS ("qwen3-4b nanbeige4.1-3b"), EXTRA_ARGS (passed to the run, e.g. "--block-size 32" or
# "--overhead-gib 1.5"). Each model runs in a process of its own: one engine with the serving settings
# for the KV budget, then one engine per workload. Writes $OUT/memory-STAMP.{json,md,png} (the plot only
# where matplotlib is installed; otherwise `python -m tokenmill.bench memory --replot FILE.json` draws it
# later) and $OUT/SUMMARY.md, printed at the end.
set -uo pipefail

MODELS=${MODELS:-"qwen3-4b nanbeige4.1-3b"}
EXTRA_ARGS=${EXTRA_ARGS:-}

source "$(dirname "$0")/env.sh"

{
  date -Is
  echo "commit $TOKENMILL_GIT_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python -c "import triton; print('triton', triton.__version__)" 2>/dev/null || true
  python -c "import matplotlib; print('matplotlib', matplotlib.__version__)" 2>/dev/null || echo "no matplotlib"
} | tee "$OUT/env.txt"

FAILED=0
args=()
for model in $MODELS; do
  # Materialise the random-weight preset once, outside the timed run.
  t0=$SECONDS
  python -m tokenmill.bench prepare --model "preset:$model" || { echo "prepare $model failed" >&2; FAILED=1; continue; }
  echo "### prepared preset:$model in $((SECONDS - t0)) s" >&2
  args+=(--model "preset:$model")
done

name="memory-$(date +%Y%m%d-%H%M%S)"
t0=$SECONDS
# shellcheck disable=SC2086
if [ ${#args[@]} -gt 0 ] && python -m tokenmill.bench memory "${args[@]}" --output-dir "$OUT" --name "$name" $EXTRA_ARGS; then
  echo "### $name done in $((SECONDS - t0)) s" >&2
else
  echo "### $name FAILED after $((SECONDS - t0)) s" >&2
  FAILED=1
fi
[ -f "$OUT/$name.md" ] && cp "$OUT/$name.md" "$OUT/SUMMARY.md"

echo
echo "==================== summary ($OUT/SUMMARY.md) ===================="
cat "$OUT/SUMMARY.md" 2>/dev/null || echo "(no results)"
exit $FAILED
