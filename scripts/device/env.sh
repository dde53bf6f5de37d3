# Sourced by the device scripts here, from the repository root: the repository's source on PYTHONPATH, a
# cache for materialised presets, the commit that results record, unbuffered output, and $OUT (default
# ./bench_results) created.
OUT=${OUT:-$PWD/bench_results}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENMILL_CACHE=${TOKENMILL_CACHE:-/tmp/tokenmill-cache}
export TOKENMILL_GIT_COMMIT=${TOKENMILL_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
