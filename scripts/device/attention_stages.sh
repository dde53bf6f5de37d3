#!/usr/bin/env bash
# Decode and prefill attention with each tile's pages loaded a tile ahead (lab/attention_pages_ahead.patch) at
# 2-4 software-pipelining stages, against the shipped kernels, in CUDA graphs; tables in $OUT/sweep.md.
set -uo pipefail
source "$(dirname "$0")/env.sh"

rm -rf .pa && mkdir .pa && cp -r src .pa/src && (cd .pa && patch -p1 -s < ../lab/attention_pages_ahead.patch)
base=${PYTHONPATH#"$PWD/src"}
for i in 1 2; do
  PYTHONPATH="$PWD/src$base" python lab/attention_config_sweep.py --graph --label shipped$i --configs 64x4x2x96,64x4x3x96 --prefill-stages 3 2>&1 | grep "^|"
  PYTHONPATH="$PWD/.pa/src$base" python lab/attention_config_sweep.py --graph --label ahead$i --configs 64x4x2x96,64x4x3x96,64x4x4x96 --prefill-stages 3,4 2>&1 | grep "^|"
done | tee $OUT/sweep.md
