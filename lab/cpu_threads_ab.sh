#!/usr/bin/env bash
# The served engine core's CPU threads, trees side by side on this machine: for each turn, tree and
# neighbour (none, or one `while True: pass` process), `tokenmill serve src/tokenmill/assets/tiny` and
# `tokenmill bench serve` at three levels: 384 requests of 16 tokens in and out at concurrency 64
# (completions endpoint), then 64-256 in / 32-128 out at concurrency 4 and 32 (chat, 6 requests a unit of
# concurrency). One line per level: tree, neighbour, level, bench serve's row (req/s is the fifth column).
#   mkdir -p .ab_old && git archive 202d5d0 src | tar x -C .ab_old
#   TREES="old=.ab_old/src new=src" TURNS=2 bash lab/cpu_threads_ab.sh
set -euo pipefail
TREES=${TREES:-"new=src"}; TURNS=${TURNS:-1}; PORT=${PORT:-8140}; OUT=${OUT:-/tmp/cpu_threads_ab}
mkdir -p "$OUT"
bench() {  # name endpoint in out n c
  python -m tokenmill.bench serve --base-url "http://127.0.0.1:$PORT" --endpoint "$2" --dataset random \
    --input-len-range "$3" --output-len-range "$4" --num-prompts "$5" --max-concurrency "$6" --no-progress \
    --output-dir "$OUT" --name "$1" 2>&1 | grep "^| tokenmill" | cut -d'|' -f1-12
}
for turn in $(seq "$TURNS"); do
  for busy in 0 1; do
    for spec in $TREES; do
      name=${spec%%=*}; tree=${spec#*=}
      PYTHONPATH=$tree python -m tokenmill.cli serve src/tokenmill/assets/tiny --port "$PORT" --device cpu \
        --disable-log-stats --log-level warning > "$OUT/server-$name.log" 2>&1 &
      server=$!
      until curl -s -o /dev/null "http://127.0.0.1:$PORT/health"; do sleep 0.3; done
      neighbour=""
      if [ "$busy" = 1 ]; then python -c "while True: pass" & neighbour=$!; fi
      echo "$name busy=$busy short-c64 $(bench "$name-$turn-$busy-short" /v1/completions 16:16 16:16 384 64)"
      for c in 4 32; do
        echo "$name busy=$busy c$c $(bench "$name-$turn-$busy-c$c" /v1/chat/completions 64:256 32:128 $((c * 6)) "$c")"
      done
      [ -n "$neighbour" ] && kill "$neighbour"
      kill -TERM "$server"; wait "$server" || true
    done
  done
done
