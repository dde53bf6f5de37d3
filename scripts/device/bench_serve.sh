#!/usr/bin/env bash
# Online serving benchmark on the GPU machine: tokenmill against the transformers baselines (hf-cb, hf),
# each served with the same OpenAI API and measured by the same client. Run from the repository root
# (fastapi, uvicorn, pydantic and httpx must be importable: install the carried wheels first):
#
#   OUT=/path/to/results bash scripts/device/bench_serve.sh
#
# Each backend in BACKENDS is started in turn on a free port (`tokenmill serve MODEL --backend B
# --tokenizer TOKDIR`), swept over its concurrency levels with the mixed-chat workload (NUM_PROMPTS per
# level, the same requests at every level) and stopped before the next one starts. Results are saved after
# every level and re-packed after every backend, so a run cut short by the time limit keeps what finished.
# Output under $OUT: bench_serve.tar.gz (result JSON, server logs, report) and SUMMARY.md (printed last).
#
# Time: tokenmill ~2.5 min (load + graph capture + sweep), hf-cb ~2 min, hf ~77 ms per token, so its
# 8 prompts x ~200 tokens take ~2 min. Trim with the variables below to fit the budget, e.g.
#   BACKENDS="tokenmill hf-cb" TM_NUM_PROMPTS=200 bash scripts/device/bench_serve.sh
set -uo pipefail

MODEL=${MODEL:-preset:qwen3-4b}
BACKENDS=${BACKENDS:-"tokenmill hf-cb hf"}
TM_NUM_PROMPTS=${TM_NUM_PROMPTS:-48}
TM_LEVELS=${TM_LEVELS:-1,4,8,16,32}
HF_CB_NUM_PROMPTS=${HF_CB_NUM_PROMPTS:-24}
HF_CB_LEVELS=${HF_CB_LEVELS:-4,16}
HF_NUM_PROMPTS=${HF_NUM_PROMPTS:-8}
HF_LEVELS=${HF_LEVELS:-16}          # it serves one request at a time: one level gives its req/s
ENDPOINT=${ENDPOINT:-/v1/chat/completions}
DATASET=${DATASET:-mixed-chat}
SERVER_ARGS=${SERVER_ARGS:-}        # extra `tokenmill serve` flags for the tokenmill backend
TTFT_PROBE=${TTFT_PROBE:-16}        # tokenmill only: this many 1,000-token prompts at concurrency 1 (0: none)
BENCH_ARGS=${BENCH_ARGS:-}          # extra `tokenmill bench serve` flags, e.g. "--goodput ttft:500 tpot:50"
START_TIMEOUT_S=${START_TIMEOUT_S:-300}

source "$(dirname "$0")/env.sh"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/bench-serve.XXXXXX")
RES="$WORK/bench_serve"
mkdir -p "$RES"
SUMMARY="$OUT/SUMMARY.md"
SLUG=${MODEL#preset:}
SLUG=${SLUG##*/}
FAILED=0
T0=$SECONDS

HARDWARE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
HARDWARE=${HARDWARE:-$(uname -m) CPU}
{
  date -Is
  echo "commit $TOKENMILL_GIT_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$RES/env.txt" 2>&1
cat "$RES/env.txt"
python -c "import fastapi, uvicorn, pydantic, httpx" || { echo "fastapi/uvicorn/pydantic/httpx missing: install the wheels first" >&2; exit 2; }

pack() {        # re-pack everything so far and rewrite SUMMARY.md
  local runs=() b
  for b in $BACKENDS; do [ -f "$RES/serve-$b.json" ] && runs+=("$RES/serve-$b.json"); done
  [ -f "$RES/serve-tokenmill-1000in.json" ] && runs+=("$RES/serve-tokenmill-1000in.json")
  if [ ${#runs[@]} -gt 0 ]; then
    python -m tokenmill.bench report "${runs[@]}" --output-dir "$RES/report" > /dev/null 2>> "$RES/report.log"
  fi
  {
    echo "# bench serve: $MODEL, $DATASET, $ENDPOINT ($((SECONDS - T0)) s so far)"
    echo
    sed 's/^/    /' "$RES/env.txt"
    echo
    [ -f "$RES/report/REPORT.md" ] && grep -v '^!\[' "$RES/report/REPORT.md" | cat -s
    [ -f "$RES/notes.txt" ] && { echo; echo '```'; cat "$RES/notes.txt"; echo '```'; }
  } > "$SUMMARY"
  tar -czf "$OUT/bench_serve.tar.gz.tmp" -C "$WORK" bench_serve && mv "$OUT/bench_serve.tar.gz.tmp" "$OUT/bench_serve.tar.gz"
}
t=$SECONDS
python -m tokenmill.bench prepare --model "$MODEL" > "$RES/prepare.log" 2>&1 || { note "prepare $MODEL failed"; cat "$RES/prepare.log" >&2; pack; exit 1; }
MODEL_DIR=$(tail -1 "$RES/prepare.log")
TOKDIR="$WORK/tokenizer"
python -m tokenmill.bench.serve_datasets --model "$MODEL" --output "$TOKDIR" > /dev/null || { note "tokenizer failed"; pack; exit 1; }
note "prepared $MODEL ($MODEL_DIR) and tokenizer in $((SECONDS - t)) s"

for backend in $BACKENDS; do
  case $backend in
    tokenmill) n=$TM_NUM_PROMPTS; levels=$TM_LEVELS; extra=$SERVER_ARGS ;;
    hf-cb)     n=$HF_CB_NUM_PROMPTS; levels=$HF_CB_LEVELS; extra="" ;;
    hf)        n=$HF_NUM_PROMPTS; levels=$HF_LEVELS; extra="" ;;
    *) note "unknown backend $backend"; FAILED=1; continue ;;
  esac
  log="$RES/server-$backend.log"
  t=$SECONDS
  # shellcheck disable=SC2086
  python -m tokenmill.cli serve "$MODEL" --backend "$backend" --tokenizer "$TOKDIR" --port 0 \
    --served-model-name "$SLUG" --log-level warning $extra > "$log" 2>&1 &
  pid=$!
  url=""
  while [ -z "$url" ] && kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t)) -lt "$START_TIMEOUT_S" ]; do
    sleep 1
    url=$(grep -o 'on http://[0-9.]*:[0-9]*' "$log" | head -1 | cut -c4-)
  done
  if [ -z "$url" ]; then
    note "$backend: server did not start in $((SECONDS - t)) s"; tail -20 "$log" >&2
    kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; FAILED=1; pack; continue
  fi
  note "$backend: serving on $url after $((SECONDS - t)) s"
  t=$SECONDS
  # shellcheck disable=SC2086
  python -m tokenmill.bench serve --base-url "$url" --endpoint "$ENDPOINT" --model "$SLUG" --label "$backend" \
    --dataset "$DATASET" --num-prompts "$n" --max-concurrency "$levels" --hardware "$HARDWARE" \
    --output-dir "$RES" --name "serve-$backend" --no-progress $BENCH_ARGS > "$RES/bench-$backend.log" 2>&1
  rc=$?
  grep -E "^$backend c=" "$RES/bench-$backend.log" >&2
  [ $rc -ne 0 ] && { note "$backend: bench exit $rc"; tail -5 "$RES/bench-$backend.log" >&2; FAILED=1; }
  note "$backend: sweep $levels x $n prompts in $((SECONDS - t)) s"
  if [ "$backend" = tokenmill ] && [ "$TTFT_PROBE" -gt 0 ]; then
    # the issue's latency case: one 1,000-token prompt at a time (completions endpoint, random ids)
    python -m tokenmill.bench serve --base-url "$url" --endpoint /v1/completions --model "$SLUG" \
      --label "$backend-1000in" --dataset random --input-len-range 1000,1000 --output-len-range 64,64 \
      --num-prompts "$TTFT_PROBE" --max-concurrency 1 --hardware "$HARDWARE" --output-dir "$RES" \
      --name "serve-$backend-1000in" --no-progress > "$RES/bench-$backend-1000in.log" 2>&1 \
      || { note "$backend: 1000-token probe failed"; FAILED=1; }
    grep -E "c=" "$RES/bench-$backend-1000in.log" >&2
  fi
  kill "$pid" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  pack
done

finish_run
