#!/usr/bin/env bash
# A big step's attention beside its products on two streams (lab/two_stream_overlap.py), bf16 and FP8
# weights + KV, qwen3-4b. Tables to stdout, rows under $OUT.
set -euo pipefail
source scripts/device/env.sh
python -m tokenmill.bench prepare --model preset:qwen3-4b >/dev/null
python lab/two_stream_overlap.py --out "$OUT/two-stream-bf16.json" 2>&1 | grep -v Warning | tee "$OUT/two-stream-bf16.txt" | tail -9
python lab/two_stream_overlap.py --fp8 --out "$OUT/two-stream-fp8.json" 2>&1 | grep -v Warning | tee "$OUT/two-stream-fp8.txt" | tail -9
