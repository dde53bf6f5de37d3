#!/usr/bin/env bash
# Block-size study on the GPU machine: block sizes 16, 32, 64 and 128 on the default offline workload
# (NUM_PROMPTS requests, 100-1,024 in and out) and the long-prompt workload (LONG_PROMPTS requests,
# 6,000-8,000 in, 64-256 out) of `tokenmill bench throughput`, greedy, eos ignored, default engine flags.
# Run from the repository root:
#
#   OUT=/path/to/results bash scripts/device/bench_block_size.sh
#
# First tests/kernels/test_block_sizes.py with its gpu tests (every size through CUDA graphs and the
# compiled kernels gives block size 16's tokens; ~30 s; TESTS=0 skips it). Then one process per block
# size (lab/block_size_study.py: Triton compiles the attention kernels per page size, ~40-60 s per size
# with both workloads) measures output tok/s and the KV waste: slots reserved in partly filled blocks
# against the tokens stored, computed from the workload's lengths and measured from the block manager
# after every step. Time: ~4-5 min. Output: $OUT/SUMMARY-block-size.md (printed last) and
# $OUT/bench_block_size.tar.gz (one JSON per block size, logs).
set -uo pipefail

MODEL=${MODEL:-preset:qwen3-4b}
BLOCK_SIZES=${BLOCK_SIZES:-"16 32 64 128"}
NUM_PROMPTS=${NUM_PROMPTS:-256}
LONG_PROMPTS=${LONG_PROMPTS:-64}
WORKLOADS=${WORKLOADS:-default,long}
TESTS=${TESTS:-1}
EXTRA_ARGS=${EXTRA_ARGS:-}          # passed to every run of lab/block_size_study.py

source "$(dirname "$0")/env.sh"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/bench-block-size.XXXXXX")
RES="$WORK/bench_block_size"
mkdir -p "$RES"
SUMMARY="$OUT/SUMMARY-block-size.md"
FAILED=0
T0=$SECONDS
{
  date -Is
  echo "commit $TOKENMILL_GIT_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$RES/env.txt" 2>&1
pack() {
  local runs=("$RES"/block-*.json)
  {
    echo "# block sizes: $MODEL, workloads $WORKLOADS ($((SECONDS - T0)) s so far)"
    echo
    sed 's/^/    /' "$RES/env.txt"
    echo
    [ -e "${runs[0]}" ] && python lab/block_size_study.py summary "${runs[@]}"
    echo
    echo "KV waste = slots reserved in partly filled blocks / tokens stored. Computed from the lengths: final"
    echo "(each request at its longest), life (over its decode steps); measured from the block manager after"
    echo "every step of the timed run: mean (summed over steps) and peak (at the step with most blocks in use)."
    [ -f "$RES/notes.txt" ] && { echo; echo '```'; cat "$RES/notes.txt"; echo '```'; }
  } > "$SUMMARY"
  tar -czf "$OUT/bench_block_size.tar.gz.tmp" -C "$WORK" bench_block_size && mv "$OUT/bench_block_size.tar.gz.tmp" "$OUT/bench_block_size.tar.gz"
}

if [ "$TESTS" = 1 ]; then
  t=$SECONDS
  python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/kernels/test_block_sizes.py > "$RES/tests.log" 2>&1
  rc=$?
  note "tests/kernels/test_block_sizes.py (gpu included): $(tail -1 "$RES/tests.log") in $((SECONDS - t)) s"
  [ $rc -ne 0 ] && { FAILED=1; tail -30 "$RES/tests.log" >&2; }
fi

t=$SECONDS
python -m tokenmill.bench prepare --model "$MODEL" > "$RES/prepare.log" 2>&1 || { note "prepare $MODEL failed"; cat "$RES/prepare.log" >&2; pack; exit 1; }
MODEL_DIR=$(tail -1 "$RES/prepare.log")
note "prepared $MODEL in $((SECONDS - t)) s"

for bs in $BLOCK_SIZES; do
  t=$SECONDS
  # shellcheck disable=SC2086
  if python lab/block_size_study.py run --model "$MODEL_DIR" --block-size "$bs" --workloads "$WORKLOADS" \
      --num-prompts "$NUM_PROMPTS" --long-prompts "$LONG_PROMPTS" --output "$RES/block-$bs.json" $EXTRA_ARGS \
      > "$RES/block-$bs.log" 2>&1; then
    note "block size $bs: $(grep -c 'out tok/s' "$RES/block-$bs.log") workloads in $((SECONDS - t)) s"
  else
    note "block size $bs FAILED after $((SECONDS - t)) s"; tail -20 "$RES/block-$bs.log" >&2; FAILED=1
  fi
  pack
done

finish_run
