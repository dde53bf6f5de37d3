#!/usr/bin/env bash
# Stream-K FP8 products of 64-256 rows (lab/fp8_streamk.py) against bf16 and the shipped fp8_linear, on
# one H200, from the repository root (about 5 minutes with both models):
#   OUT=/path MODELS=qwen3-4b,nanbeige4.1-3b ROWS=64,128,192,256 bash scripts/device/fp8_streamk.sh
# Table in $OUT/fp8_streamk.md (printed last), every variant's time in $OUT/fp8_streamk.json.
set -uo pipefail
source "$(dirname "$0")/env.sh"
python lab/fp8_streamk.py --out "$OUT" --models "${MODELS:-qwen3-4b,nanbeige4.1-3b}" --rows "${ROWS:-64,128,192,256}" \
  > "$OUT/streamk.log" 2>&1 || { tail -30 "$OUT/streamk.log"; exit 1; }
tail -25 "$OUT/fp8_streamk.md"
