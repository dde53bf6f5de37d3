#!/usr/bin/env bash
# Materialises presets into $TOKENMILL_CACHE side by side (each runner here prepares its own model first,
# one at a time; a cold machine takes minutes a preset), so that the runners of the calls after it start
# at once while the machine stays warm. From the repository root:
#   [MODELS="qwen3-4b nanbeige4.1-3b"] bash scripts/device/prepare_presets.sh
# Each preset's log is $OUT/prepare-<model>.log; the seconds each took print last.
set -uo pipefail
source "$(dirname "$0")/env.sh"
MODELS=${MODELS:-"qwen3-4b nanbeige4.1-3b"}
declare -A pid
for m in $MODELS; do
  ( t0=$SECONDS; python -m tokenmill.bench prepare --model "preset:$m" > "$OUT/prepare-$m.log" 2>&1
    rc=$?; echo "$m: $((SECONDS - t0)) s, exit $rc" >> "$OUT/prepare-times.txt"; exit $rc ) &
  pid[$m]=$!
done
FAILED=0
for m in $MODELS; do wait "${pid[$m]}" || { FAILED=1; tail -5 "$OUT/prepare-$m.log"; }; done
cat "$OUT/prepare-times.txt"
exit $FAILED
