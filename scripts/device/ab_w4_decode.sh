#!/usr/bin/env bash
# Batch-1 decode of AWQ 4-bit g128 models, two trees in alternating turns on one machine (old, new, new,
# old): `bench_w4.py`'s decode_ms per model, the AWQ checkpoints quantized once into /tmp; the new side's
# first turn also times bf16. Prints one "ROW side model ms/token graph-replay-ms" line per run.
#
# Before the device run, put the older commit's source next to this tree (the folder is not tracked):
#   mkdir -p .ab_old && git archive "$OLD" src | tar x -C .ab_old
# then, on the GPU machine, from the repository root (carry .ab_old and .whl with the tree):
#   [W4_MODELS=qwen3-4b,nanbeige4.1-3b] bash scripts/device/ab_w4_decode.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
[ -d .ab_old/src ] || { echo "no .ab_old/src: see the head of this script" >&2; exit 2; }
base=${PYTHONPATH#"$PWD/src"}
for side in old new new2 old2; do
  src=$PWD/src
  case $side in old*) src=$PWD/.ab_old/src ;; esac
  PYTHONPATH="$src$base" python - "$side" <<'PY' 2>&1 | grep -E "^ROW|Error"
import os, sys
sys.path.insert(0, "scripts/device")
import bench_w4 as b
side = sys.argv[1]
for model in os.environ.get("W4_MODELS", "qwen3-4b,nanbeige4.1-3b").split(","):
    bf16, awq = b.awq_preset(model)
    rows = [b.decode_ms(awq, f"{side} {model} awq")]
    if side == "new":
        rows.append(b.decode_ms(bf16, f"{side} {model} bf16"))
    for r in rows:
        print("ROW", r["model"], round(r["ms_per_token"], 4), round(r["graph_replay_ms"], 4), flush=True)
PY
done
