#!/usr/bin/env bash
# Offline throughput of two commits on one machine, in alternating turns (old, new, old, new...), so the
# ratio is not a machine-to-machine difference. tokenmill alone, the default random workload, qwen3-4b.
#
# Before the device run, put the older commit's source next to this tree (the folder is not tracked):
#   mkdir -p .ab_old && git archive "$OLD" src | tar x -C .ab_old && echo /.ab_old/ >> .git/info/exclude
# then, on the GPU machine, from the repository root (carry .ab_old with the tree):
#   OLD=<old commit> NEW=<this commit> [TURNS=2] [MODEL=qwen3-4b] [SIDES="old new"] [ARGS="..."] \
#     [NAME=ab] bash scripts/device/ab_throughput.sh
# ARGS: more `bench throughput` arguments for both sides (e.g. "--temperature 0.8 --top-p 0.95" or
# "--quantization fp8 --kv-cache-dtype fp8"; given after the default workload's, they override it, e.g.
# "--num-prompts 64 --input-len-range 6000,8000 --output-len-range 64,256"); SIDES: the sides each turn
# runs, in order (OLD is needed only with old).
# Prints one table row per turn and side; results (JSON, markdown, logs) under $OUT/$NAME.
set -uo pipefail
source "$(dirname "$0")/env.sh"
OLD=${OLD:-}
NEW=${NEW:-$TOKENMILL_GIT_COMMIT}
TURNS=${TURNS:-2}
MODEL=${MODEL:-qwen3-4b}
SIDES=${SIDES:-old new}
ARGS=${ARGS:-}
NAME=${NAME:-ab}
case " $SIDES " in *" old "*) [ -n "$OLD" ] && [ -d .ab_old/src ] || { echo "SIDES has old: set OLD and put its src in .ab_old (see the head of this script)" >&2; exit 2; } ;; esac
base=${PYTHONPATH#"$PWD/src"}    # env.sh put this tree first; each turn picks its own source
mkdir -p "$OUT/$NAME"
python -m tokenmill.bench prepare --model "preset:$MODEL" > "$OUT/$NAME/prepare.log" 2>&1
for turn in $(seq 1 "$TURNS"); do
  for side in $SIDES; do
    if [ $side = old ]; then src=$PWD/.ab_old/src commit=$OLD; else src=$PWD/src commit=$NEW; fi
    TOKENMILL_GIT_COMMIT=$commit PYTHONPATH="$src$base" python -m tokenmill.bench throughput \
      --model "preset:$MODEL" --backend tokenmill --dataset random --num-prompts 256 \
      --input-len-range 100,1024 --output-len-range 100,1024 --seed 0 --no-progress $ARGS \
      --output-dir "$OUT/$NAME" --name "$side$turn" > "$OUT/$NAME/$side$turn.log" 2>&1
    echo "$NAME $side$turn $commit $(grep '^| tokenmill' "$OUT/$NAME/$side$turn.md" 2>/dev/null || echo FAILED)"
  done
done
