#!/usr/bin/env bash
# Decode steps of a few batch sizes under several source trees on one machine, in turns (each tree once a
# turn): profile_decode.py's engine ms per step and decode graph replay at each batch. From the repository
# root on the GPU machine, each tree's source beside this one (untracked folders carried with the tree):
#   TREES="old=.ab_old/src new=src" [BATCHES=16,64,128] [TURNS=1] [MODEL=qwen3-4b] \
#     [ARGS="--quantization fp8 --kv-cache-dtype fp8"] bash scripts/device/ab_batches.sh
# Prints a table (one row per run and batch); each run's profile and log under $OUT/ab_batches.
set -uo pipefail
source "$(dirname "$0")/env.sh"
TREES=${TREES:?name=path pairs, e.g. "old=.ab_old/src new=src"}
BATCHES=${BATCHES:-16,64,128}
TURNS=${TURNS:-1}
MODEL=${MODEL:-qwen3-4b}
ARGS=${ARGS:-}
base=${PYTHONPATH#"$PWD/src"}    # env.sh put this tree first; each run picks its own source
mkdir -p "$OUT/ab_batches"
for turn in $(seq 1 "$TURNS"); do
  for tree in $TREES; do
    name=${tree%%=*} path=${tree#*=}
    dir="$OUT/ab_batches/${MODEL}_$name$turn"
    # shellcheck disable=SC2086
    PYTHONPATH="$PWD/$path$base" python scripts/device/profile_decode.py --model "preset:$MODEL" \
      --batch-sizes "$BATCHES" --prefill-lens "" --output-len 64 --out "$dir" $ARGS > "$dir.log" 2>&1 \
      || tail -5 "$dir.log"
    grep '^{"model"' "$dir.log" | sed "s/^/$name$turn /" >> "$OUT/ab_batches/rows.txt"
  done
done
python - "$OUT/ab_batches/rows.txt" <<'PY'
import json, sys
print("| run | batch | step ms | graph replay ms |")
print("|---|---|---|---|")
rows = [(line.split(" ", 1)[0], json.loads(line.split(" ", 1)[1])) for line in open(sys.argv[1])]
for run, r in sorted(rows, key=lambda x: (x[1]["batch"], x[0])):
    print(f"| {run} | {r['batch']} | {r['step_ms']:.4f} | {r['graph_replay_ms']:.4f} |")
PY
