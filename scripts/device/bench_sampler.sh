#!/usr/bin/env bash
# The sampler on one GPU, from the repository root (a few minutes, most of it compiling):
#   1. tests/kernels/test_sampling_kernel.py compiled on the GPU, its gpu-marked tests included (the kernel
#      against the torch reference at a 151,936-token vocabulary; sample() with logit_bias and logprobs)
#   2. lab/sampler_bench.py: sample() through the kernel against the torch path it replaced and greedy, at
#      batch 1, 64, 256, with its correctness columns (the script's docstring explains each column)
# Output under $OUT: sampling_tests.log, sampler_bench.log, sampler_bench.json, sampler_bench.md; the table
# is printed last. Exit status 1 if the tests or the bench's correctness checks failed.
#   OUT=/path bash scripts/device/bench_sampler.sh        BATCHES=1,64,256 ITERS=20
set -uo pipefail
BATCHES=${BATCHES:-1,64,256}
ITERS=${ITERS:-20}
source "$(dirname "$0")/env.sh"
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null | head -1
python -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/kernels/test_sampling_kernel.py \
  > "$OUT/sampling_tests.log" 2>&1 || status=1
echo "sampling tests on the GPU: $(tail -1 "$OUT/sampling_tests.log")"
[ $status -ne 0 ] && grep -E "^(FAILED|ERROR|E )" "$OUT/sampling_tests.log" | head -20
python lab/sampler_bench.py --batches "$BATCHES" --iters "$ITERS" --out "$OUT" > "$OUT/sampler_bench.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  status=1
  echo "sampler_bench: exit $rc (1: a correctness check failed, see the table; else the log's tail follows)"
  [ $rc -ne 1 ] && tail -25 "$OUT/sampler_bench.log"
fi
[ -f "$OUT/sampler_bench.md" ] && { echo; cat "$OUT/sampler_bench.md"; }
exit $status
