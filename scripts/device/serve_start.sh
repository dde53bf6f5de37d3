#!/usr/bin/env bash
# A served start on the GPU, two source trees in turns: seconds from spawning `tokenmill serve MODEL` to its
# first 200 of /health, and the CPU seconds of all its processes (lab/serve_start_time.py), from the
# repository root, .whl and the older tree's src carried as .ab_old/src (its assets linked to this tree's):
#   [MODELS="preset:qwen3-4b"] [RUNS=3] [ARGS="--quantization fp8"] bash scripts/device/serve_start.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
[ -d .ab_old/src/tokenmill ] || { echo "no .ab_old/src: carry the older tree's src there"; exit 1; }
[ -e .ab_old/src/tokenmill/assets ] || ln -s "$PWD/src/tokenmill/assets" .ab_old/src/tokenmill/assets
status=0
for model in ${MODELS:-preset:qwen3-4b}; do
  python -m tokenmill.bench prepare --model "$model" > "$OUT/prepare.log" 2>&1 || { tail -5 "$OUT/prepare.log"; exit 1; }
  # shellcheck disable=SC2086
  python lab/serve_start_time.py --trees .ab_old/src src --runs "${RUNS:-3}" -- "$model" --device cuda ${ARGS:-} \
    | tee "$OUT/serve-start-${model#preset:}.md" || status=1
done
exit $status
