#!/usr/bin/env bash
# The served rows of a freshly started server, as a user's first clients see them: this tree's src ("new") and
# another commit's ("old", from the copy's git; default HEAD, the last landed commit) in the order of TURNS, each
# `bench_serve.sh` with BACKENDS=tokenmill and an empty Triton cache of its own, so that whatever a first
# burst compiles is paid inside the level. One line per run (tree, level, req/s, TPOT p50, TTFT p99); the
# summaries under $OUT. About 1.5 minutes a run at TM_LEVELS=64.
#   OUT=/path [OLD=c2ecbcc] [TURNS="old new"] TM_LEVELS=64 \
#     SERVER_ARGS="--quantization fp8 --kv-cache-dtype fp8 --api-server-count 2 --stream-interval 4" \
#     bash scripts/device/cold_serve.sh                     # carry .whl
set -uo pipefail
OUT=${OUT:-$PWD/bench_results}; OLD=${OLD:-HEAD}; TURNS=${TURNS:-"old new"}
mkdir -p "$OUT" .ab_old && git archive "$OLD" src | tar x -C .ab_old
root=$PWD
(source scripts/device/env.sh)      # installs the carried server wheels once, from the root where .whl is
for turn in $TURNS; do
  dir=$root; label="$(git rev-parse --short HEAD)+tree"
  [ "$turn" = old ] && dir=$root/.ab_old && label=$(git rev-parse --short "$OLD")
  out=$OUT/$turn-$SECONDS
  (cd "$dir" && TOKENMILL_GIT_COMMIT=$label TRITON_CACHE_DIR=$(mktemp -d) TM_NUM_PROMPTS=${TM_NUM_PROMPTS:-512} TTFT_PROBE=0 BACKENDS=tokenmill \
     OUT=$out bash "$root/scripts/device/bench_serve.sh" > "$out.log" 2>&1)
  grep "^| tokenmill" "$out/SUMMARY.md" | awk -F'|' -v t="$turn" '{print t, "c"$3, "req/s"$5, "TPOT p50"$12, "TTFT p99"$10}'
done
