#!/usr/bin/env bash
# lab/compile_ahead.py on the GPU machine, from the repository root (.whl carried): its check on a toy kernel,
# then an engine's start in a fresh Triton cache with every capture specialization compiled ahead on a
# thread pool, and one as the capture compiles them today, each in its own process; the ready seconds,
# the capture summaries and the greedy tokens (equal in both) print last. With TESTS=1 (default) the GPU
# engine tests (tests/test_gpu_engine.py: graphs against eager, no compile after ready) run first with the
# capture compiled ahead.
#   [MODEL=preset:nanbeige4.1-3b] [ARGS="--quantization fp8 --kv-cache-dtype fp8"] [TESTS=1] bash scripts/device/compile_ahead.sh
set -uo pipefail
MODEL=${MODEL:-preset:nanbeige4.1-3b}
ARGS=${ARGS---quantization fp8 --kv-cache-dtype fp8}
source "$(dirname "$0")/env.sh"
python lab/compile_ahead.py check || exit 1
if [ "${TESTS:-1}" = 1 ]; then
  python - <<'PY' 2>&1 | tail -5
import sys
sys.path.insert(0, "lab")
import compile_ahead
import pytest
compile_ahead.capture_compiled_ahead()
sys.exit(pytest.main(["-q", "-m", "gpu", "tests/test_gpu_engine.py", "-p", "no:cacheprovider"]))
PY
fi
python -m tokenmill.bench prepare --model "$MODEL" > "$OUT/prepare.log" 2>&1 || { tail -5 "$OUT/prepare.log"; exit 1; }
for mode in ahead serial; do
  cache=$(mktemp -d)
  # shellcheck disable=SC2086
  TRITON_CACHE_DIR=$cache python lab/compile_ahead.py ready $mode "$MODEL" $ARGS > "$OUT/compile-ahead-$mode.log" 2>&1 \
    || tail -20 "$OUT/compile-ahead-$mode.log"
  rm -rf "$cache"
done
echo "==================== $MODEL $ARGS, commit $TOKENMILL_GIT_COMMIT ===================="
grep -h "ready in" "$OUT"/compile-ahead-*.log
