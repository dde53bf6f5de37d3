#!/usr/bin/env bash
# Batch-1 decode latency of two commits on one machine, in alternating turns (old, new, old, new...), so
# the difference is not a machine-to-machine one: profile_decode.py at batch 1 (32 prompt tokens, 128
# generated) for each side, the engine's ms per step and the decode graph's replay.
#
# Before the device run, put the older commit's source next to this tree (the folder is not tracked):
#   rm -rf .ab_old && mkdir -p .ab_old && git archive "$OLD" src | tar x -C .ab_old
#   grep -q ab_old .git/info/exclude || echo /.ab_old/ >> .git/info/exclude
# then, on the GPU machine, from the repository root (carry .ab_old with the tree):
#   OLD=<old commit> NEW=<this commit> [TURNS=2] [MODELS="qwen3-4b nanbeige4.1-3b"] bash scripts/device/ab_latency.sh
# Prints one table row per run; each run's profile and log under $OUT/ab_latency.
set -uo pipefail
source "$(dirname "$0")/env.sh"
OLD=${OLD:?the older commit, whose source is in .ab_old/src}
NEW=${NEW:-$TOKENMILL_GIT_COMMIT}
TURNS=${TURNS:-2}
MODELS=${MODELS:-"qwen3-4b nanbeige4.1-3b"}
[ -d .ab_old/src ] || { echo "no .ab_old/src: see the head of this script" >&2; exit 2; }
base=${PYTHONPATH#"$PWD/src"}    # env.sh put this tree first; each run picks its own source
mkdir -p "$OUT/ab_latency"
echo "| model | run | commit | step ms | graph replay ms | step - graph us | GPU while replaying |"
echo "|---|---|---|---|---|---|---|"
for m in $MODELS; do
  for turn in $(seq 1 "$TURNS"); do
    for side in old new; do
      if [ $side = old ]; then src=$PWD/.ab_old/src commit=$OLD; else src=$PWD/src commit=$NEW; fi
      dir="$OUT/ab_latency/${m}_$side$turn"
      TOKENMILL_GIT_COMMIT=$commit PYTHONPATH="$src$base" python scripts/device/profile_decode.py \
        --model "preset:$m" --batch-sizes 1 --prefill-lens "" --output-len 128 --out "$dir" > "$dir.log" 2>&1
      python scripts/device/latency_row.py "$dir" "$m" "$side$turn" "$commit"
    done
  done
done
