#!/usr/bin/env bash
# The eager warm-up steps above the graphs (`ModelRunner._warm_eager`, fp8_gemm.PATH_ROWS) on the GPU machine,
# from the repository root (.whl carried): the no-compile GPU test on this tree, its FP8 case on another
# commit's src (OLD, default HEAD, the last landed commit; it fails there where that src compiles inside a
# step), the FP8 kernel tests, then an FP8 qwen3-4b engine's start on each src, from an empty Triton cache
# and again with it warm (`cold_start.sh`), so that what the warm-up costs at start shows. Lines print last.
#   [OLD=8143689] bash scripts/device/warm_bands.sh
set -uo pipefail
OLD=${OLD:-HEAD}
source "$(dirname "$0")/env.sh"
root=$PWD
mkdir -p .ab_old && git archive "$OLD" src | tar x -C .ab_old
python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py -k no_kernel_compiles > "$OUT/test-new.log" 2>&1
PYTHONPATH=$root/.ab_old/src:$PYTHONPATH python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py \
  -k "no_kernel_compiles and fp8" > "$OUT/test-old.log" 2>&1
python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_gemm.py tests/test_fp8.py > "$OUT/test-fp8.log" 2>&1
lines=("no-compile test, this tree: $(tail -1 "$OUT/test-new.log")"
       "no-compile FP8 case, $(git rev-parse --short "$OLD")'s src: $(tail -1 "$OUT/test-old.log")"
       "$(grep "^E *AssertionError" "$OUT/test-old.log" | head -1 | cut -c1-400)"
       "FP8 kernel tests: $(tail -1 "$OUT/test-fp8.log")")
if [ "${STARTS:-1}" = 1 ]; then
  for turn in old new; do
    dir=$root; [ "$turn" = old ] && dir=$root/.ab_old
    (cd "$dir" && OUT=$OUT/start-$turn TESTS=0 RUNS="preset:qwen3-4b|--quantization fp8 --kv-cache-dtype fp8" \
       bash "$root/scripts/device/cold_start.sh" > "$OUT/start-$turn.log" 2>&1)
    while read -r l; do lines+=("$turn: $l"); done < <(grep "Triton cache" "$OUT/start-$turn.log")
  done
fi
printf '%s\n' "${lines[@]}"
