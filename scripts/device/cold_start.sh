#!/usr/bin/env bash
# An engine's start on the GPU machine, from the repository root (.whl carried): the compile-ahead test and
# the GPU engine tests (graphs against eager, no compile after ready), then for each model an engine start
# in a fresh Triton cache and one with that cache warm, each in its own process: the ready seconds, the
# capture's summary (with what was compiled ahead of it) and the greedy tokens of a fixed prompt (equal in
# both) print last; each start's log under $OUT.
# STATES (default "fresh warm"): a state "plain" is a fresh start with the capture's compile-ahead replaced by
# nothing (the baseline, timed in the same run).
#   [RUNS="preset:qwen3-4b|  preset:nanbeige4.1-3b|--quantization fp8 --kv-cache-dtype fp8"] [TESTS=1] \
#     [STATES="fresh plain"] bash scripts/device/cold_start.sh
set -uo pipefail
RUNS=${RUNS:-"preset:qwen3-4b|;preset:nanbeige4.1-3b|--quantization fp8 --kv-cache-dtype fp8"}
source "$(dirname "$0")/env.sh"
status=0
if [ "${TESTS:-1}" = 1 ]; then
  python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_compile_ahead.py tests/test_gpu_engine.py \
    > "$OUT/gpu_tests.log" 2>&1 || status=1
  echo "GPU tests: $(tail -1 "$OUT/gpu_tests.log")"
fi
IFS=';' read -ra runs <<< "$RUNS"
for run in "${runs[@]}"; do
  model=${run%%|*}; args=${run#*|}
  python -m tokenmill.bench prepare --model "$model" > "$OUT/prepare.log" 2>&1 || { tail -5 "$OUT/prepare.log"; exit 1; }
  cache=$(mktemp -d)
  for cacheState in ${STATES:-fresh warm}; do
    log="$OUT/start-${model#preset:}-$cacheState.log"
    # fresh and plain start from an empty Triton cache whatever state ran before them; warm reuses the last one's
    case $cacheState in
      fresh|plain) rm -rf "$cache"; cache=$(mktemp -d) ;;
      warm) ;;
      *) echo "STATES: unknown state '$cacheState' (fresh, warm, plain)"; exit 1 ;;
    esac
    plain=""; [ "$cacheState" = plain ] && plain="--plain"
    # shellcheck disable=SC2086
    TRITON_CACHE_DIR=$cache python - "$model" $args $plain > "$log" 2>&1 <<'PY' || { status=1; tail -20 "$log"; }
import argparse, contextlib, sys, time
p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--quantization")
p.add_argument("--kv-cache-dtype", default="auto")
p.add_argument("--plain", action="store_true")
a = p.parse_args()
if a.plain:
    import tokenmill.runner.cuda_graphs as cuda_graphs
    from tokenmill.runner.compile_ahead import CompiledAhead
    cuda_graphs.compile_ahead = lambda: contextlib.nullcontext(CompiledAhead())
t0 = time.perf_counter()
from tokenmill import LLM, SamplingParams
llm = LLM(a.model, quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype)
seconds = time.perf_counter() - t0
out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print(f"ready in {seconds:.1f} s; graphs {llm.engine.runner.graph_summary}; "
      f"tokens {list(out[0].outputs[0].token_ids)}", flush=True)
PY
    echo "$model $args, $cacheState Triton cache: $(grep '^ready in' "$log")"
  done
  rm -rf "$cache"
done
exit $status
