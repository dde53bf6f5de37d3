#!/usr/bin/env bash
# Batch-1 decode latency under two environment settings on one machine, in alternating turns (A, B, A,
# B...): profile_decode.py at batch 1 (32 prompt tokens, 128 generated), the engine's ms per step and the
# decode graph's replay. From the repository root on the GPU machine:
#   ENV_A="PYTHONPATH=/path/a/src" ENV_B="PYTHONPATH=/path/b/src" [TURNS=2] [MODELS=qwen3-4b] \
#     bash scripts/device/env_ab.sh
# Settings are words (no spaces inside a value). Optional: NAME_A / NAME_B, the runs' names (default A and
# B); LABEL_A / LABEL_B, what the table shows for each side (default its settings) under LABEL_HEADER
# (default "settings"); SUBDIR (default env_ab). Prints one table row per run; each run's profile and log
# under $OUT/$SUBDIR. ab_latency.sh runs two commits through this.
set -uo pipefail
source "$(dirname "$0")/env.sh"
ENV_A=${ENV_A:?settings for side A, e.g. "PYTHONPATH=/path/a/src"}
ENV_B=${ENV_B:?settings for side B}
NAME_A=${NAME_A:-A} NAME_B=${NAME_B:-B}
LABEL_A=${LABEL_A:-$ENV_A} LABEL_B=${LABEL_B:-$ENV_B}
SUBDIR=${SUBDIR:-env_ab}
TURNS=${TURNS:-2}
MODELS=${MODELS:-"qwen3-4b"}
mkdir -p "$OUT/$SUBDIR"
echo "| model | run | ${LABEL_HEADER:-settings} | step ms | graph replay ms | step - graph us | GPU while replaying |"
echo "|---|---|---|---|---|---|---|"
for m in $MODELS; do
  for turn in $(seq 1 "$TURNS"); do
    for side in A B; do
      if [ $side = A ]; then settings=$ENV_A name=$NAME_A label=$LABEL_A; else settings=$ENV_B name=$NAME_B label=$LABEL_B; fi
      dir="$OUT/$SUBDIR/${m}_$name$turn"
      env $settings python scripts/device/profile_decode.py --model "preset:$m" --batch-sizes 1 \
        --prefill-lens "" --output-len 128 --out "$dir" > "$dir.log" 2>&1
      python scripts/device/latency_row.py "$dir" "$m" "$name$turn" "$label"
    done
  done
done
