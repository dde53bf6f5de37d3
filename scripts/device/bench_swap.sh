#!/usr/bin/env bash
# Swap against recompute preemption on the GPU machine, with the KV cache oversubscribed about 3x by long
# outputs. Run from the repository root:
#
#   OUT=/path/to/results bash scripts/device/bench_swap.sh
#
# The same requests (NUM_PROMPTS, prompts INPUT_LEN_RANGE, outputs OUTPUT_LEN_RANGE, eos ignored) go
# through `tokenmill bench throughput` once per mode, each in its own process:
#   roomy      the KV cache sized by --gpu-memory-utilization: no preemption, the reference
#   swap       --num-kv-blocks NUM_KV_BLOCKS, --preemption-mode swap --swap-space SWAP_SPACE
#   recompute  --num-kv-blocks NUM_KV_BLOCKS, --preemption-mode recompute
# With the defaults, MAX_NUM_SEQS=64 requests of ~1.7K tokens at their end want ~110K tokens of KV
# against 2,304 blocks of 16 = 36,864 tokens (3x), and the excess (~74K tokens x 144 KiB on qwen3-4b,
# ~10 GiB) fits in SWAP_SPACE=16 GiB, so that swap mode rarely falls back to recompute; the table says
# how many blocks were swapped. The pinned swap space is allocated at start-up: see time to ready.
# tests/test_swap.py runs first, its gpu-marked tests included. Each run writes NAME.json / NAME.md under
# $OUT; the table is printed at the end and saved as $OUT/SWAP.md.
set -uo pipefail

MODEL=${MODEL:-qwen3-4b}            # a preset name, or a model directory
MODES=${MODES:-"roomy swap recompute"}
NUM_PROMPTS=${NUM_PROMPTS:-128}
INPUT_LEN_RANGE=${INPUT_LEN_RANGE:-128,256}
OUTPUT_LEN_RANGE=${OUTPUT_LEN_RANGE:-1024,2048}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-64}
NUM_KV_BLOCKS=${NUM_KV_BLOCKS:-2304}
SWAP_SPACE=${SWAP_SPACE:-16}
EXTRA_ARGS=${EXTRA_ARGS:-}          # passed to every run, e.g. "--enforce-eager"

source "$(dirname "$0")/env.sh"

{
  date -Is
  echo "commit $TOKENMILL_GIT_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  free -g | head -2
} | tee "$OUT/env-swap.txt"

STAMP=$(date +%Y%m%d-%H%M%S)
FAILED=0
# the swap path's own tests on the device first (side stream, pinned memory, graphs): a wrong copy would
# make the numbers below meaningless
python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/test_swap.py 2>&1 | tee "$OUT/swap_tests.log" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "tests/test_swap.py failed: see $OUT/swap_tests.log" >&2; FAILED=1; }
if [ -d "$MODEL" ]; then SPEC=$MODEL; TAG=$(basename "$MODEL"); else
  SPEC="preset:$MODEL"; TAG=$MODEL
  python -m tokenmill.bench prepare --model "$SPEC" || exit 1
fi

for mode in $MODES; do
  case $mode in
    roomy)     args=(--swap-space 0) ;;
    swap)      args=(--num-kv-blocks "$NUM_KV_BLOCKS" --preemption-mode swap --swap-space "$SWAP_SPACE") ;;
    recompute) args=(--num-kv-blocks "$NUM_KV_BLOCKS" --preemption-mode recompute --swap-space 0) ;;
    *) echo "unknown mode $mode" >&2; FAILED=1; continue ;;
  esac
  name="swap-$TAG-$mode-$STAMP"
  echo "### $name" >&2
  t0=$SECONDS
  # shellcheck disable=SC2086
  if ! python -m tokenmill.bench throughput --output-dir "$OUT" --name "$name" --model "$SPEC" \
      --backend tokenmill --dataset random --num-prompts "$NUM_PROMPTS" --input-len-range "$INPUT_LEN_RANGE" \
      --output-len-range "$OUTPUT_LEN_RANGE" --max-num-seqs "$MAX_NUM_SEQS" --seed 0 --no-progress \
      "${args[@]}" $EXTRA_ARGS; then
    echo "### $name FAILED after $((SECONDS - t0)) s" >&2
    FAILED=1
  else
    echo "### $name done in $((SECONDS - t0)) s" >&2
  fi
done

python - "$OUT" "$STAMP" "$TAG" <<'EOF' | tee "$OUT/SWAP.md"
import json, os, sys
out, stamp, model = sys.argv[1:]
print(f"| mode ({model}) | KV blocks | req/s | output tok/s | p50 latency s | p99 latency s | preemptions | "
      "swapped out blocks (GiB) | time to ready s |")
print("|---|---|---|---|---|---|---|---|---|")
for mode in ("roomy", "swap", "recompute"):
    path = os.path.join(out, f"swap-{model}-{mode}-{stamp}.json")
    if not os.path.exists(path):
        continue
    r = json.load(open(path))["results"][0]
    gib = r.get("swap_out_bytes", 0) / 2**30
    print(f"| {mode} | {r.get('num_total_blocks')} | {r['requests_s']:.2f} | {r['output_tok_s']:,.0f} | "
          f"{r.get('p50_latency_s', float('nan')):.1f} | {r.get('p99_latency_s', float('nan')):.1f} | "
          f"{r.get('num_preemptions', 0)} | {r.get('swapped_out_blocks', 0):,} ({gib:.1f}) | "
          f"{r['time_to_ready_s']:.1f} |")
EOF
exit $FAILED
