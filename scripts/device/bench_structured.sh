#!/usr/bin/env bash
# The cost of structured output on one GPU: `tokenmill serve preset:qwen3-4b`, then `tokenmill bench serve`
# mixed-chat at concurrency 64, all plain and with a quarter of the requests under a JSON schema
# (bench/serve_payload.py's BENCH_SCHEMA through `response_format` json_schema), the same requests in both runs.
# Reported: req/s, output tok/s and TPOT p50 of each run, and in the mixed run the TPOT of the constrained
# and of the plain requests apart.
#
# The GPU machine has no network and no xgrammar: carry its wheel. Here, from the repository root:
#   ../shared/device/wheels.sh                # server wheels into ./.whl (fastapi, uvicorn, pydantic, openai)
#   python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --no-deps -d .whl xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
# (--no-deps: xgrammar's own dependencies would bring torch's 2 GB of CUDA wheels; the machine has torch,
# transformers and triton, and pydantic comes with the server wheels), then run with carry [".whl"]:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD/src:${PYTHONPATH:-}; OUT=$OUT bash scripts/device/bench_structured.sh
# check_structured.py (correctness on the GPU, ~1 min) needs only xgrammar, apache-tvm-ffi and pydantic.
#
# The preset has random weights, so outputs are not meaningful text; ignore_eos is sent (as in
# bench_serve.sh), but a constrained request still ends where its grammar ends (EOS is then the only token
# allowed), so compare TPOT, not only req/s; output tokens of each part are in the JSON.
# Time: load + graph capture ~1.5 min, each run of NUM_PROMPTS at concurrency 64 ~1 min.
# Output under $OUT: bench_structured.tar.gz (result JSONs, server log) and SUMMARY.md (printed last).
set -uo pipefail

MODEL=${MODEL:-preset:qwen3-4b}
NUM_PROMPTS=${NUM_PROMPTS:-256}
CONCURRENCY=${CONCURRENCY:-64}
FRACTION=${FRACTION:-0.25}
SERVER_ARGS=${SERVER_ARGS:-}
START_TIMEOUT_S=${START_TIMEOUT_S:-300}

source "$(dirname "$0")/env.sh"
python -c "import fastapi, uvicorn, pydantic, httpx, xgrammar" \
  || { echo "fastapi/uvicorn/pydantic/httpx/xgrammar missing: install the carried wheels first" >&2; exit 2; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/bench-structured.XXXXXX")
RES="$WORK/bench_structured"
mkdir -p "$RES"
SLUG=${MODEL#preset:}
SLUG=${SLUG##*/}
HARDWARE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
T0=$SECONDS
FAILED=0

python -m tokenmill.bench prepare --model "$MODEL" > "$RES/prepare.log" 2>&1 || { cat "$RES/prepare.log" >&2; exit 1; }
TOKDIR="$WORK/tokenizer"
python -m tokenmill.bench.serve_datasets --model "$MODEL" --output "$TOKDIR" > /dev/null || exit 1

log="$RES/server.log"
t=$SECONDS
# shellcheck disable=SC2086
python -m tokenmill.cli serve "$MODEL" --tokenizer "$TOKDIR" --port 0 --served-model-name "$SLUG" \
  --log-level warning $SERVER_ARGS > "$log" 2>&1 &
pid=$!
url=""
while [ -z "$url" ] && kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t)) -lt "$START_TIMEOUT_S" ]; do
  sleep 1
  url=$(grep -o 'on http://[0-9.]*:[0-9]*' "$log" | head -1 | cut -c4-)
done
[ -z "$url" ] && { echo "server did not start in $((SECONDS - t)) s" >&2; tail -20 "$log" >&2; kill "$pid"; exit 1; }
echo "serving on $url after $((SECONDS - t)) s" >&2

for run in plain structured; do
  fraction=0; [ "$run" = structured ] && fraction=$FRACTION
  python -m tokenmill.bench serve --base-url "$url" --endpoint /v1/chat/completions --model "$SLUG" \
    --label "tokenmill-$run" --dataset mixed-chat --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY" \
    --structured-fraction "$fraction" --hardware "$HARDWARE" --output-dir "$RES" --name "$run" --no-progress \
    > "$RES/bench-$run.log" 2>&1 || { echo "$run: bench failed" >&2; tail -5 "$RES/bench-$run.log" >&2; FAILED=1; }
  grep -E "c=" "$RES/bench-$run.log" >&2
done

kill "$pid" 2>/dev/null
for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null

python - "$RES" > "$OUT/SUMMARY.md" <<'PY'
import json, os, sys
res = sys.argv[1]
print("# structured output cost: mixed-chat, chat endpoint\n")
print("| run | ok/n | req/s | out tok/s | TPOT p50 ms | TPOT p50 constrained | TPOT p50 plain | out tokens constrained / plain |")
print("|---|---|---|---|---|---|---|---|")
for run in ("plain", "structured"):
    path = os.path.join(res, f"{run}.json")
    if not os.path.exists(path):
        print(f"| {run} | (no result) |||||||")
        continue
    levels = [json.loads(line) for line in open(path) if line.strip()]      # a level a line
    for m in levels:
        f = lambda k: "-" if m.get(k) is None else f"{m[k]:.2f}"
        print(f"| {run} c={m['max_concurrency']} | {m['completed']}/{m['num_requests']} | {m['request_throughput']:.2f} | "
              f"{m['output_throughput']:.0f} | {m['median_tpot_ms']:.2f} | {f('median_tpot_ms_structured')} | "
              f"{f('median_tpot_ms_plain')} | {m.get('output_tokens_structured', '-')} / {m.get('output_tokens_plain', '-')} |")
    d = levels[0]
    print(f"\ncommit {d['git_commit']}, {d['hardware']}, {d['date']}" if run == "structured" else "", end="")
print()
PY
tar -czf "$OUT/bench_structured.tar.gz" -C "$WORK" bench_structured
rm -rf "$WORK"
echo "total $((SECONDS - T0)) s" >&2
cat "$OUT/SUMMARY.md"
exit $FAILED
