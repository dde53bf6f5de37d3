#!/usr/bin/env bash
# The GPU follow-ups of the architectures and attention features added last (sliding windows, Gemma 2's soft
# caps, Gemma 3, Phi-3's partial rotary, SmolLM3, YaRN) and of Granite's FP8 at load, from the repository root,
# the newest first so that a call's time limit cuts the oldest. Results under $OUT (granite.txt,
# window_attention.txt: the windowed and soft-capped kernels checked and timed, gpu_tests.log).
#   OUT=/path bash scripts/device/new_models.sh           # carry .whl; TESTS_TIMEOUT (s, default 400, or less
#                                                         # where the labs leave less of a 600 s call)
set -uo pipefail
source "$(dirname "$0")/env.sh"
status=0
timeout 120 python lab/granite_fp8_at_load.py --device cuda 2>&1 | tr '\r' '\n' | grep -v "Capturing\|Writing" \
  | tee "$OUT/granite.txt" | tail -40 || status=1
timeout 150 python lab/window_attention_bench.py --device cuda 2>&1 | tee "$OUT/window_attention.txt" | tail -45 \
  || status=1
tests_timeout=$((580 - SECONDS)); ((tests_timeout > 400)) && tests_timeout=400
timeout "${TESTS_TIMEOUT:-$tests_timeout}" python -m pytest -q -m gpu -p no:cacheprovider --durations=12 \
  tests/test_sliding_window.py tests/test_gemma2.py tests/test_gemma3.py tests/kernels/test_decode_attention.py \
  tests/kernels/test_paged_attention.py tests/kernels/test_gemv.py tests/kernels/test_fused_ops.py \
  tests/test_phi3.py tests/test_smollm3.py tests/test_yarn.py tests/test_swap.py tests/test_granite.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -40 || status=1
exit $status
