#!/usr/bin/env bash
# Batch-1 decode latency of this tree under two environment settings on one machine, in alternating
# turns (A, B, A, B...): profile_decode.py at batch 1 (32 prompt tokens, 128 generated), the engine's ms
# per step and the decode graph's replay. From the repository root on the GPU machine:
#   ENV_A="TOKENMILL_PDL=1" ENV_B="TOKENMILL_PDL=2" [TURNS=2] [MODELS=qwen3-4b] \
#     bash scripts/device/env_ab.sh
# Prints one table row per run; each run's profile and log under $OUT/env_ab.
set -uo pipefail
source "$(dirname "$0")/env.sh"
ENV_A=${ENV_A:?settings for side A, e.g. "TOKENMILL_X=0"}
ENV_B=${ENV_B:?settings for side B}
TURNS=${TURNS:-2}
MODELS=${MODELS:-"qwen3-4b"}
mkdir -p "$OUT/env_ab"
echo "| model | run | settings | step ms | graph replay ms | step - graph us | GPU while replaying |"
echo "|---|---|---|---|---|---|---|"
for m in $MODELS; do
  for turn in $(seq 1 "$TURNS"); do
    for side in A B; do
      if [ $side = A ]; then settings=$ENV_A; else settings=$ENV_B; fi
      dir="$OUT/env_ab/${m}_$side$turn"
      env $settings python scripts/device/profile_decode.py --model "preset:$m" --batch-sizes 1 \
        --prefill-lens "" --output-len 128 --out "$dir" > "$dir.log" 2>&1
      python scripts/device/latency_row.py "$dir" "$m" "$side$turn" "$settings"
    done
  done
done
