#!/usr/bin/env bash
# FP8 KV cache (--kv-cache-dtype fp8) against the model-dtype cache (auto, bf16) on the GPU machine. Run
# from the repository root:
#
#   OUT=/path/to/results bash scripts/device/bench_kv_fp8.sh
#
# 1. tests/test_kv_fp8.py and tests/kernels/test_kv_fp8_kernels.py, gpu-marked tests included (the kernels
#    compiled for the GPU against the torch reference, the engine with CUDA graphs and a profile-sized
#    cache): if they fail, nothing is timed (the numbers would mean nothing).
# 2. `tokenmill bench throughput` on MODEL, one process per (workload, KV dtype):
#      default  NUM_PROMPTS requests, 100-1,024 tokens in, 100-1,024 out
#      long     LONG_PROMPTS requests, 6,000-8,000 in, 64-256 out
#    each with --kv-cache-dtype auto and fp8, the cache sized by --gpu-memory-utilization (profiled).
# The table (output tok/s, fp8 / auto, KV blocks and capacity in tokens, time to ready) is printed last and
# saved as $OUT/SUMMARY-kv-fp8.md; every run also writes NAME.json / NAME.md under $OUT.
set -uo pipefail

MODEL=${MODEL:-qwen3-4b}            # a preset name, or a model directory
WORKLOADS=${WORKLOADS:-"default long"}
KV_DTYPES=${KV_DTYPES:-"auto fp8"}
NUM_PROMPTS=${NUM_PROMPTS:-256}
LONG_PROMPTS=${LONG_PROMPTS:-64}
RUN_TESTS=${RUN_TESTS:-1}
EXTRA_ARGS=${EXTRA_ARGS:-}          # passed to every run, e.g. "--enforce-eager"

source "$(dirname "$0")/env.sh"

{
  date -Is
  echo "commit $TOKENMILL_GIT_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$OUT/env-kv-fp8.txt"

STAMP=$(date +%Y%m%d-%H%M%S)
FAILED=0
if [ "$RUN_TESTS" = 1 ]; then
  t0=$SECONDS
  python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -s tests/test_kv_fp8.py tests/kernels/test_kv_fp8_kernels.py \
    > "$OUT/kv_fp8_tests.log" 2>&1
  rc=$?
  grep -E "perplexity|max \|log p|L1|passed|failed|error" "$OUT/kv_fp8_tests.log" | tail -8
  echo "### tests done in $((SECONDS - t0)) s (exit $rc)" >&2
  if [ $rc -ne 0 ]; then
    echo "FP8 KV tests failed: see $OUT/kv_fp8_tests.log; nothing timed" | tee "$OUT/SUMMARY-kv-fp8.md" >&2
    exit 1
  fi
fi

if [ -d "$MODEL" ]; then SPEC=$MODEL; TAG=$(basename "$MODEL"); else
  SPEC="preset:$MODEL"; TAG=$MODEL
  t0=$SECONDS
  python -m tokenmill.bench prepare --model "$SPEC" || exit 1
  echo "### prepared $SPEC in $((SECONDS - t0)) s" >&2
fi

for workload in $WORKLOADS; do
  case $workload in
    default) shape=(--num-prompts "$NUM_PROMPTS" --input-len-range 100,1024 --output-len-range 100,1024) ;;
    long)    shape=(--num-prompts "$LONG_PROMPTS" --input-len-range 6000,8000 --output-len-range 64,256) ;;
    *) echo "unknown workload $workload" >&2; FAILED=1; continue ;;
  esac
  for kv in $KV_DTYPES; do
    name="kvfp8-$TAG-$workload-$kv-$STAMP"
    echo "### $name" >&2
    t0=$SECONDS
    # shellcheck disable=SC2086
    if python -m tokenmill.bench throughput --output-dir "$OUT" --name "$name" --model "$SPEC" --backend tokenmill \
        --dataset random "${shape[@]}" --seed 0 --no-progress --kv-cache-dtype "$kv" $EXTRA_ARGS; then
      echo "### $name done in $((SECONDS - t0)) s" >&2
    else
      echo "### $name FAILED after $((SECONDS - t0)) s" >&2
      FAILED=1
    fi
  done
done

echo
echo "==================== summary ($OUT/SUMMARY-kv-fp8.md) ===================="
python - "$OUT" "$STAMP" "$TAG" "$WORKLOADS" "$KV_DTYPES" <<'EOF' | tee "$OUT/SUMMARY-kv-fp8.md"
import json, os, sys
out, stamp, model, workloads, kvs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(), sys.argv[5].split()
print(f"FP8 KV cache on {model}, commit {os.environ.get('TOKENMILL_GIT_COMMIT', '?')}\n")
print("| workload | KV dtype | output tok/s | vs auto | req/s | KV blocks | KV capacity (tokens) | peak blocks used | "
      "preemptions | time to ready s |")
print("|---|---|---|---|---|---|---|---|---|---|")
for w in workloads:
    base = None
    for kv in kvs:
        path = os.path.join(out, f"kvfp8-{model}-{w}-{kv}-{stamp}.json")
        if not os.path.exists(path):
            print(f"| {w} | {kv} | (failed) | | | | | | | |")
            continue
        r = json.load(open(path))["results"][0]
        tok = r["output_tok_s"]
        base = tok if kv == "auto" else base
        ratio = f"{tok / base:.2f}x" if base else "-"
        blocks = r.get("num_total_blocks", 0)
        print(f"| {w} | {kv} | {tok:,.0f} | {ratio} | {r['requests_s']:.2f} | {blocks:,} | "
              f"{blocks * r.get('block_size', 16):,} | {r.get('peak_blocks_used', 0):,} | {r.get('num_preemptions', 0)} | "
              f"{r['time_to_ready_s']:.1f} |")
EOF
exit $FAILED
