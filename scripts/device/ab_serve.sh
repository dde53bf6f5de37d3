#!/usr/bin/env bash
# The served rows of two trees in turns on one GPU: this tree's src ("new") and another commit's ("old", from
# the copy's git; default HEAD, the last landed commit), each `bench_serve.sh` with BACKENDS=tokenmill, in the
# order new, old, old, new after a first run of each tree that is not counted (a fresh machine's first server
# compiles the kernels and materialises the preset while it serves: 111 s against 53 for the next); one line
# per run (tree, level, req/s, TPOT p50, TTFT p99) and the summaries under $OUT. About a minute a run at
# TM_LEVELS=64, so six runs fit one call.
#   OUT=/path [OLD=161c8b2] MODEL=preset:nanbeige4.1-3b TM_LEVELS=64 \
#     SERVER_ARGS="--quantization fp8 --kv-cache-dtype fp8 --api-server-count 2 --stream-interval 4" \
#     bash scripts/device/ab_serve.sh                     # carry .whl
set -uo pipefail
OUT=${OUT:-$PWD/bench_results}; OLD=${OLD:-HEAD}
mkdir -p "$OUT" .ab_old && git archive "$OLD" src | tar x -C .ab_old
root=$PWD
for turn in warm-new warm-old new old old new; do
  dir=$root; [ "${turn#warm-}" = old ] && dir=$root/.ab_old
  out=$OUT/$turn-$SECONDS
  (cd "$dir" && TM_NUM_PROMPTS=${TM_NUM_PROMPTS:-512} TTFT_PROBE=0 BACKENDS=tokenmill OUT=$out \
     bash "$root/scripts/device/bench_serve.sh" > "$out.log" 2>&1)
  grep "^| tokenmill" "$out/SUMMARY.md" | awk -F'|' -v t="$turn" '{print t, "c"$3, "req/s"$5, "TPOT p50"$12, "TTFT p99"$10}'
done
