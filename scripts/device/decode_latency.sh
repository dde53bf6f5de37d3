#!/usr/bin/env bash
# Batch-1 decode on the GPU machine, from the repository root:
#   tests     the gpu-marked kernel and engine tests
#   e2e       scripts/device/profile_decode.py at batch 1 for each model: the engine's ms per step, the
#             decode graph's replay and its kernels ($OUT/e2e_<model>)
#   timeline  profile_decode.py --timeline at batch 1: device events of a graph replay and of engine
#             steps ($OUT/timeline/timeline_<model>.json; scripts/device/timeline_report.py reads them)
#   OUT=/path STAGES="tests e2e" MODELS="qwen3-4b nanbeige4.1-3b" bash scripts/device/decode_latency.sh
set -uo pipefail
STAGES=${STAGES:-"tests e2e"}
MODELS=${MODELS:-"qwen3-4b nanbeige4.1-3b"}
source "$(dirname "$0")/env.sh"
status=0
for stage in $STAGES; do
  case $stage in
    tests)
      python -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -6 || status=1 ;;
    e2e|timeline)
      extra=""
      [ "$stage" = timeline ] && extra=--timeline
      for m in $MODELS; do
        dir="$OUT/${stage}_$m"
        python scripts/device/profile_decode.py --model "preset:$m" --batch-sizes 1 --prefill-lens "" \
          --output-len 128 --out "$dir" $extra > "$dir.log" 2>&1 || { status=1; tail -20 "$dir.log"; }
        [ -f "$dir/timeline_$m.json" ] && python scripts/device/timeline_report.py "$dir/timeline_$m.json" \
          | tee "$dir/timeline_report.txt"
        grep '^|' "$dir.log" | tail -1
      done ;;
  esac
done
exit $status
