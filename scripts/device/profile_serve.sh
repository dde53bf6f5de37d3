#!/usr/bin/env bash
# The step profile on the GPU machine: where an engine step's time goes while serving, and where the API
# server's and the offline engine's CPU time goes. Run from the repository root, the carried wheels in
# .whl/srv (server) and .whl/tools (py-spy):
#
#   OUT=/path/to/results bash scripts/device/profile_serve.sh
#
# 1. `tokenmill serve MODEL` with the engine core's phase timers (lab/step_profile.py) and, for each
#    concurrency level in LEVELS, `tokenmill bench serve` (mixed-chat, NUM_PROMPTS requests or the level
#    if more, rate inf; each level its own prompts, --seed its index, so that no level finds its prompts
#    in the prefix cache from the level before); the core's phases per step for that level are printed
#    from the timers' snapshots around it, and the server's own mean latencies from /metrics
#    (lab/server_latency.py), beside the client's. At level SPY_LEVEL, py-spy samples the API server and
#    the engine core for SPY_SECONDS; each level's CPU seconds of the API server(s) and the engine core
#    (lab/proc_cpu.py) show whether either was busy all the level. With TTFT_PROBE=N, N 1,000-token
#    prompts at concurrency 1 (64 tokens out) follow.
# 2. Offline, each stage of OFFLINE ("" for none): short (OFFLINE_PROMPTS requests, 50-300 in / 50-300
#    out, --max-num-seqs 512, under py-spy), default (256 requests, 100-1024 in / out, greedy) and
#    sampled (the default workload at temperature 0.8, top_p 0.95, seeded).
# LEVELS="" with TTFT_PROBE=0 starts no server (offline stages only). $OUT/levels-window holds the unix times
# the levels began and ended (with GC_LOG_DIR and lab/gc_log on PYTHONPATH, lab/gc_log/summary.py reads
# the collections between them).
# Output: $OUT/SUMMARY.md (printed last), the raw profiles and logs beside it.
set -uo pipefail

MODEL=${MODEL:-preset:qwen3-4b}
LEVELS=${LEVELS-"64 256"}
NUM_PROMPTS=${NUM_PROMPTS:-512}
SPY_LEVEL=${SPY_LEVEL:-256}
SPY_SECONDS=${SPY_SECONDS:-8}
SPY_DELAY=${SPY_DELAY:-12}        # seconds before py-spy starts: the client starts first (~13 s on the H200 host, 4 processes)
OFFLINE=${OFFLINE-short}
TTFT_PROBE=${TTFT_PROBE:-0}
OFFLINE_PROMPTS=${OFFLINE_PROMPTS:-2048}
SERVER_ARGS=${SERVER_ARGS:-}
CLIENT_PROCESSES=${CLIENT_PROCESSES:-1}      # bench serve --client-processes: processes reading the streams
START_TIMEOUT_S=${START_TIMEOUT_S:-300}

source "$(dirname "$0")/env.sh"
SITE=/tmp/site
python -c "import fastapi, uvicorn, uvloop" 2>/dev/null || python -m pip install -q --no-index --no-deps --target "$SITE" .whl/srv/*.whl
python -m pip install -q --no-index --no-deps --target /tmp/tools .whl/tools/*.whl 2>/dev/null
export PYTHONPATH="$PWD/lab:$SITE:$PYTHONPATH"
SPY=/tmp/tools/bin/py-spy
SUMMARY="$OUT/SUMMARY.md"
SLUG=${MODEL#preset:}
HARDWARE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
T0=$SECONDS
{ echo "# step profile: $MODEL, commit $TOKENMILL_GIT_COMMIT, $HARDWARE"; echo; } > "$SUMMARY"

python -m tokenmill.bench prepare --model "$MODEL" > "$OUT/prepare.log" 2>&1 || { cat "$OUT/prepare.log"; exit 1; }
TOKDIR=/tmp/profile-tokenizer
python -m tokenmill.bench.serve_datasets --model "$MODEL" --output "$TOKDIR" > /dev/null || exit 1

export STEP_PROFILE_OUT="$OUT/core-profile.json"
if [ -n "${LEVELS// }" ] || [ "$TTFT_PROBE" -gt 0 ]; then
log="$OUT/server.log"
# shellcheck disable=SC2086
python -m tokenmill.cli serve "$MODEL" --tokenizer "$TOKDIR" --port 0 --served-model-name "$SLUG" \
  --log-level warning --engine-factory step_profile:make $SERVER_ARGS > "$log" 2>&1 &
pid=$!
url=""
t=$SECONDS
while [ -z "$url" ] && kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t)) -lt "$START_TIMEOUT_S" ]; do
  sleep 1
  url=$(grep -o 'on http://[0-9.]*:[0-9]*' "$log" | head -1 | cut -c4-)
done
[ -z "$url" ] && { echo "server did not start"; tail -30 "$log"; exit 1; }
core=$(grep -o 'engine pid [0-9]*' "$log" | head -1 | awk '{print $3}')
echo "serving on $url after $((SECONDS - t)) s (api $pid, core $core)" | tee -a "$SUMMARY"

level=0
LEVELS_T0=$(date +%s.%N)
for c in $LEVELS; do
  level=$((level + 1))
  sleep 2.5                      # the timers write every 2 s: the snapshot below is this level's start
  cp "$STEP_PROFILE_OUT" "$OUT/core-before-$c.json" 2>/dev/null || echo '{"seconds":{},"calls":{},"extra":{}}' > "$OUT/core-before-$c.json"
  spies=()
  if [ "$c" = "$SPY_LEVEL" ] && [ -x "$SPY" ]; then
    ( sleep "$SPY_DELAY"; timeout $((SPY_SECONDS + 20)) "$SPY" record --nonblocking -d "$SPY_SECONDS" -r 200 -f raw -p "$pid" -o "$OUT/spy-api-c$c.txt" > "$OUT/spy-api.log" 2>&1 ) &
    spies+=($!)
    ( sleep "$SPY_DELAY"; timeout $((SPY_SECONDS + 20)) "$SPY" record --nonblocking -d "$SPY_SECONDS" -r 200 -f raw -p "$core" -o "$OUT/spy-core-c$c.txt" > "$OUT/spy-core.log" 2>&1 ) &
    spies+=($!)
  fi
  curl -s "$url/metrics" > "$OUT/metrics-before-$c.txt" 2>/dev/null
  cpu_before=$(python lab/proc_cpu.py snapshot "$pid" "$core")
  n=$(( c > NUM_PROMPTS ? c : NUM_PROMPTS ))
  python -m tokenmill.bench serve --base-url "$url" --endpoint /v1/chat/completions --model "$SLUG" \
    --label tokenmill --dataset mixed-chat --seed "$level" --num-prompts "$n" --max-concurrency "$c" \
    --hardware "$HARDWARE" --output-dir "$OUT" --name "serve-c$c" --no-progress \
    --client-processes "$CLIENT_PROCESSES" > "$OUT/bench-c$c.log" 2>&1
  cpu_after=$(python lab/proc_cpu.py snapshot "$pid" "$core")
  [ ${#spies[@]} -gt 0 ] && wait "${spies[@]}"     # not a bare wait: the server is a background job too
  sleep 2.5
  cp "$STEP_PROFILE_OUT" "$OUT/core-after-$c.json"
  curl -s "$url/metrics" > "$OUT/metrics-after-$c.txt" 2>/dev/null
  { echo; echo "## concurrency $c"; echo; grep -E "c=" "$OUT/bench-c$c.log";
    python lab/proc_cpu.py level "$cpu_before" "$cpu_after" \
      "$(grep -o '[0-9]*/[0-9]* ok, [0-9.]* req/s' "$OUT/bench-c$c.log" | awk '{split($1, n, "/"); print n[1] / $3}')";
    python lab/server_latency.py "$OUT/metrics-before-$c.txt" "$OUT/metrics-after-$c.txt"; echo;
    python lab/step_profile.py "$OUT/core-before-$c.json" "$OUT/core-after-$c.json"; } >> "$SUMMARY"
  for who in api core; do
    f="$OUT/spy-$who-c$c.txt"
    [ -s "$f" ] && { echo; echo "### py-spy: $who process, c=$c"; echo; python lab/collapsed_top.py "$f" 30; } >> "$SUMMARY"
    [ -f "$OUT/spy-$who.log" ] && [ ! -s "$f" ] && { echo; echo "py-spy ($who) failed:"; tail -3 "$OUT/spy-$who.log"; } >> "$SUMMARY"
  done
done
echo "$LEVELS_T0 $(date +%s.%N)" > "$OUT/levels-window"     # unix times, for lab/gc_log/summary.py
if [ "$TTFT_PROBE" -gt 0 ]; then
  python -m tokenmill.bench serve --base-url "$url" --endpoint /v1/completions --model "$SLUG" \
    --label tokenmill-1000in --dataset random --input-len-range 1000,1000 --output-len-range 64,64 \
    --num-prompts "$TTFT_PROBE" --max-concurrency 1 --hardware "$HARDWARE" --output-dir "$OUT" \
    --name serve-1000in --no-progress > "$OUT/bench-1000in.log" 2>&1
  { echo; echo "## concurrency 1, 1,000-token prompts"; echo; grep -E "c=" "$OUT/bench-1000in.log"; } >> "$SUMMARY"
fi
kill "$pid"; for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done; kill -9 "$pid" 2>/dev/null
fi

for stage in $OFFLINE; do
  common=(--model "$MODEL" --backend tokenmill --dataset random --seed 0 --no-progress --output-dir "$OUT")
  case $stage in
    short)   args=("${common[@]}" --num-prompts "$OFFLINE_PROMPTS" --input-len-range 50,300 --output-len-range 50,300
                   --max-num-seqs 512 --name offline-short) ;;
    default) args=("${common[@]}" --num-prompts 256 --input-len-range 100,1024 --output-len-range 100,1024
                   --name offline-default) ;;
    sampled) args=("${common[@]}" --num-prompts 256 --input-len-range 100,1024 --output-len-range 100,1024
                   --temperature 0.8 --top-p 0.95 --name offline-sampled) ;;
    *) echo "unknown offline stage $stage" >> "$SUMMARY"; continue ;;
  esac
  if [ "$stage" = short ] && [ -x "$SPY" ] && [ "${SPY_OFFLINE:-1}" = 1 ]; then
    "$SPY" record --nonblocking --subprocesses -r 100 -f raw -o "$OUT/spy-offline.txt" -- \
      python -m tokenmill.bench throughput "${args[@]}" > "$OUT/offline-$stage.log" 2>&1
  else
    python -m tokenmill.bench throughput "${args[@]}" > "$OUT/offline-$stage.log" 2>&1
  fi
  { echo; echo "## offline: $stage"; echo; cat "$OUT/offline-$stage.md" 2>/dev/null || tail -5 "$OUT/offline-$stage.log"; } >> "$SUMMARY"
  [ "$stage" = short ] && [ -s "$OUT/spy-offline.txt" ] && { echo; echo "### py-spy: offline"; echo; python lab/collapsed_top.py "$OUT/spy-offline.txt" 30; } >> "$SUMMARY"
done
echo "total $((SECONDS - T0)) s" >> "$SUMMARY"
echo "==================== summary ===================="
cat "$SUMMARY"
