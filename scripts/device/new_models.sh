#!/usr/bin/env bash
# The GPU checks of the newest changes: FP8 quantized at load against the CPU quantizer's bytes
# (scripts/device/fp8_at_load.sh, whose Granite tests build engines one after another in a process: the CUDA
# graph capture after a dead engine), thinking_token_budget under CUDA graphs and overlap, and the architectures
# and attention features added last (sliding windows, Gemma 2's soft caps, Gemma 3, Phi-3's partial rotary,
# SmolLM3, YaRN), the newest first so that a call's time limit cuts the oldest. Results under $OUT
# (fp8_at_load.txt, gpu_tests.log); lab/window_attention_bench.py times the windowed and soft-capped kernels.
#   OUT=/path bash scripts/device/new_models.sh           # carry .whl; TESTS_TIMEOUT (s, default 400, or less
#                                                         # where the checks before leave less of a 600 s call)
set -uo pipefail
source "$(dirname "$0")/env.sh"
status=0
timeout 150 bash "$(dirname "$0")/fp8_at_load.sh" || status=1
tests_timeout=$((580 - SECONDS)); ((tests_timeout > 400)) && tests_timeout=400
timeout "${TESTS_TIMEOUT:-$tests_timeout}" python -m pytest -q -m gpu -p no:cacheprovider --durations=12 \
  tests/test_thinking_budget.py tests/test_sliding_window.py tests/test_gemma2.py tests/test_gemma3.py \
  tests/kernels/test_decode_attention.py \
  tests/kernels/test_paged_attention.py tests/kernels/test_gemv.py tests/kernels/test_fused_ops.py \
  tests/test_phi3.py tests/test_smollm3.py tests/test_yarn.py tests/test_swap.py tests/test_granite.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -40 || status=1
exit $status
