#!/usr/bin/env bash
# lab/fp8_mlp_fused.py on the GPU machine, from the repository root: the fused FP8 MLP kernel against its
# float reference at qwen3-4b's shape (1-192 rows, two tiles), then shipped against fused in CUDA graphs
# at qwen3-4b's and nanbeige4.1-3b's shapes, 8-192 rows, eight tiles; the table prints last, each row's
# every variant under $OUT/fp8_mlp_fused.json.
#   bash scripts/device/fp8_mlp_fused.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
# the bench runs whatever the check says (it reports each variant's error itself)
timeout 120 python lab/fp8_mlp_fused.py check 2>&1 | tee "$OUT/fp8-mlp-check.log" | tail -12
timeout 420 python lab/fp8_mlp_fused.py bench --out "$OUT" 2>&1 | tee "$OUT/fp8-mlp-bench.log" | tail -40
