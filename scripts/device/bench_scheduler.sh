#!/usr/bin/env bash
# The scheduler's controls on the GPU machine, each against its baseline in one run, on preset:qwen3-4b
# (mixed-chat over the chat endpoint, eos ignored). Run from the repository root, with .whl/srv carried
# (fastapi, uvicorn, uvloop, httpx):
#
#   OUT=/path/to/results bash scripts/device/bench_scheduler.sh
#   PARTS="priority" bash scripts/device/bench_scheduler.sh        (one part only)
#
# Each part starts its baseline server and its variant server at the same time on two free ports, waits
# for both (~60 s: weights, CUDA graphs), benchmarks the baseline, then the variant (the idle server does
# not disturb the busy one), and stops both. Both servers get the same KV cache, NUM_KV_BLOCKS blocks of
# 16 (18,000 x 2.25 MiB = 40 GiB each on qwen3-4b; two of them with their weights and activations fit one
# H200): the size is given, not profiled, because a server that profiles subtracts the memory the other
# one holds at that moment, so two starting together would race for it. 18,000 blocks hold the 512
# mixed-chat requests at once (~215K tokens at their end), so no part preempts.
#   itl       --target-itl-ms TARGET_ITL_MS against no target, under overload: ITL_PROMPTS requests at
#             concurrency ITL_CONC (rate inf), past --max-num-seqs 256, so prefill chunks of up to 8,192
#             tokens join decode steps of 256. Judged on p99 ITL (at or under the target?) and on the
#             throughput it costs. The default target, 25 ms, is above a pure-decode step of 256 (~9 ms;
#             TPOT p50 at c256 was 8.8 ms) and below the steps that carry a full prefill chunk.
#   priority  --scheduling-policy priority (default boosts and aging) against fcfs, TOOLS_FRACTION of the
#             requests carrying tools (tool_choice auto; both servers --enable-auto-tool-choice). A queue
#             must form for an order to matter: PRIO_PROMPTS requests at concurrency PRIO_CONC against
#             --max-num-seqs PRIO_MAX_NUM_SEQS on both servers keep ~190 requests waiting. Judged on the
#             TTFT p95 of tool requests against the rest, and the longest wait (max TTFT and E2E) of any.
#   api       --api-server-count API_SERVERS against 1 (one API server process), API_PROMPTS requests at
#             concurrency API_CONC (rate inf): judged on ITL p95/p99 and throughput, where one process's
#             HTTP and detokenizing work bunches the streams' chunks.
#   delay     --scheduler-delay-factor DELAY_FACTOR against 0, Poisson arrivals at DELAY_RATE req/s (near
#             saturation for this workload at c256) for DELAY_PROMPTS requests: TTFT and throughput.
# Time: ~70 s per part for the two starts plus 20-40 s of benchmarks; ~5 min for all three.
# Output: $OUT/SUMMARY-scheduler.md (printed last) and $OUT/bench_scheduler.tar.gz (bench JSON, server and
# bench logs).
set -uo pipefail

MODEL=${MODEL:-preset:qwen3-4b}
PARTS=${PARTS:-"itl priority delay"}
NUM_KV_BLOCKS=${NUM_KV_BLOCKS:-18000}
TARGET_ITL_MS=${TARGET_ITL_MS:-25}
ITL_PROMPTS=${ITL_PROMPTS:-512}
ITL_CONC=${ITL_CONC:-512}
PRIO_PROMPTS=${PRIO_PROMPTS:-512}
PRIO_CONC=${PRIO_CONC:-256}
PRIO_MAX_NUM_SEQS=${PRIO_MAX_NUM_SEQS:-64}
TOOLS_FRACTION=${TOOLS_FRACTION:-0.2}
DELAY_FACTOR=${DELAY_FACTOR:-0.5}
DELAY_RATE=${DELAY_RATE:-85}
DELAY_PROMPTS=${DELAY_PROMPTS:-768}
DELAY_CONC=${DELAY_CONC:-256}
API_SERVERS=${API_SERVERS:-4}
API_PROMPTS=${API_PROMPTS:-1024}
API_CONC=${API_CONC:-512}
SERVER_ARGS=${SERVER_ARGS:-}        # extra `tokenmill serve` flags for every server (e.g. "--device cpu")
BENCH_ARGS=${BENCH_ARGS:-}          # extra `tokenmill bench serve` flags for every run
START_TIMEOUT_S=${START_TIMEOUT_S:-300}

source "$(dirname "$0")/env.sh"
SITE=/tmp/site
python -c "import fastapi, uvicorn, uvloop, httpx" 2>/dev/null || python -m pip install -q --no-index --no-deps --target "$SITE" .whl/srv/*.whl
export PYTHONPATH="$PWD/lab:$SITE:$PYTHONPATH"
python -c "import fastapi, uvicorn, httpx" || { echo "fastapi/uvicorn/httpx missing: carry .whl/srv" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/bench-scheduler.XXXXXX")
RES="$WORK/bench_scheduler"
mkdir -p "$RES"
SUMMARY="$OUT/SUMMARY-scheduler.md"
SLUG=${MODEL#preset:}
SLUG=${SLUG##*/}
HARDWARE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
HARDWARE=${HARDWARE:-$(uname -m) CPU}
FAILED=0
T0=$SECONDS
{
  date -Is
  echo "commit $TOKENMILL_GIT_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  python -c "import torch; print('torch', torch.__version__)"
} > "$RES/env.txt" 2>&1
pack() {        # the summary of what has finished so far, and the tarball of the details
  python lab/scheduler_summary.py "$RES" --target-itl-ms "$TARGET_ITL_MS" > "$RES/tables.md" 2>> "$RES/summary.log"
  {
    echo "# scheduler benchmarks: $MODEL, $HARDWARE ($((SECONDS - T0)) s so far)"
    echo
    sed 's/^/    /' "$RES/env.txt"
    echo
    cat "$RES/tables.md"
    [ -f "$RES/notes.txt" ] && { echo; echo '```'; cat "$RES/notes.txt"; echo '```'; }
  } > "$SUMMARY"
  tar -czf "$OUT/bench_scheduler.tar.gz.tmp" -C "$WORK" bench_scheduler && mv "$OUT/bench_scheduler.tar.gz.tmp" "$OUT/bench_scheduler.tar.gz"
}

t=$SECONDS
python -m tokenmill.bench prepare --model "$MODEL" > "$RES/prepare.log" 2>&1 || { note "prepare $MODEL failed"; cat "$RES/prepare.log" >&2; pack; exit 1; }
TOKDIR="$WORK/tokenizer"
python -m tokenmill.bench.serve_datasets --model "$MODEL" --output "$TOKDIR" > /dev/null || { note "tokenizer failed"; pack; exit 1; }
note "prepared $MODEL and its tokenizer in $((SECONDS - t)) s"

PIDS=()
URLS=()
start_server() {        # start_server LABEL FLAGS...: in the background, its log under $RES
  local label=$1; shift
  # shellcheck disable=SC2086
  python -m tokenmill.cli serve "$MODEL" --tokenizer "$TOKDIR" --port 0 --served-model-name "$SLUG" \
    --log-level warning --num-kv-blocks "$NUM_KV_BLOCKS" "$@" $SERVER_ARGS > "$RES/server-$label.log" 2>&1 &
  PIDS+=($!)
}
wait_servers() {        # wait_servers LABEL...: fills URLS in the order of PIDS; 1 if one did not start
  local t=$SECONDS i label url ok=0
  URLS=()
  for i in "${!PIDS[@]}"; do
    label=$1; shift
    url=""
    while [ -z "$url" ] && kill -0 "${PIDS[$i]}" 2>/dev/null && [ $((SECONDS - t)) -lt "$START_TIMEOUT_S" ]; do
      sleep 1
      url=$(grep -o 'on http://[0-9.]*:[0-9]*' "$RES/server-$label.log" | head -1 | cut -c4-)
    done
    if [ -z "$url" ]; then
      note "$label: server did not start in $((SECONDS - t)) s"; tail -20 "$RES/server-$label.log" >&2; ok=1
    else
      note "$label: serving on $url after $((SECONDS - t)) s"
    fi
    URLS+=("$url")
  done
  return $ok
}
stop_servers() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -9 "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null      # this server only: never a bare wait
  done
  PIDS=()
}
bench() {        # bench URL NAME ARGS...: one `bench serve` run, its JSON as $RES/NAME.json
  local url=$1 name=$2; shift 2
  local t=$SECONDS
  # shellcheck disable=SC2086
  python -m tokenmill.bench serve --base-url "$url" --endpoint /v1/chat/completions --model "$SLUG" \
    --label "$name" --dataset mixed-chat --hardware "$HARDWARE" --output-dir "$RES" --name "$name" \
    --no-progress "$@" $BENCH_ARGS > "$RES/bench-$name.log" 2>&1 || { note "$name: bench exit $?"; tail -5 "$RES/bench-$name.log" >&2; FAILED=1; }
  grep -E "^$name c=" "$RES/bench-$name.log" >&2
  note "$name: $((SECONDS - t)) s"
}

for part in $PARTS; do
  case $part in
    itl)
      base=(); variant=(--target-itl-ms "$TARGET_ITL_MS")
      names=(itl-baseline "itl-target-$TARGET_ITL_MS")
      args=(--num-prompts "$ITL_PROMPTS" --max-concurrency "$ITL_CONC" --request-rate inf) ;;
    priority)
      common=(--max-num-seqs "$PRIO_MAX_NUM_SEQS" --enable-auto-tool-choice --tool-call-parser hermes)
      base=("${common[@]}" --scheduling-policy fcfs); variant=("${common[@]}" --scheduling-policy priority)
      names=(priority-fcfs priority-priority)
      args=(--num-prompts "$PRIO_PROMPTS" --max-concurrency "$PRIO_CONC" --request-rate inf
            --tools-fraction "$TOOLS_FRACTION") ;;
    delay)
      base=(--scheduler-delay-factor 0); variant=(--scheduler-delay-factor "$DELAY_FACTOR")
      names=(delay-0 "delay-$DELAY_FACTOR")
      args=(--num-prompts "$DELAY_PROMPTS" --max-concurrency "$DELAY_CONC" --request-rate "$DELAY_RATE" --seed 0) ;;
    api)
      base=(--api-server-count 1); variant=(--api-server-count "$API_SERVERS")
      names=(api-1 "api-$API_SERVERS")
      args=(--num-prompts "$API_PROMPTS" --max-concurrency "$API_CONC" --request-rate inf) ;;
    *) note "unknown part $part (choose from: itl priority delay api)"; FAILED=1; continue ;;
  esac
  start_server "${names[0]}" "${base[@]}"
  start_server "${names[1]}" "${variant[@]}"
  if wait_servers "${names[@]}"; then
    bench "${URLS[0]}" "${names[0]}" "${args[@]}"
    bench "${URLS[1]}" "${names[1]}" "${args[@]}"
  else
    FAILED=1
  fi
  stop_servers
  pack
done

finish_run
