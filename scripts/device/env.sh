# Sourced by the device scripts here, from the repository root: the repository's source on PYTHONPATH (with
# the server's wheels where .whl/srv is carried), a cache for materialised presets, the commit that results
# record, unbuffered output, and $OUT (default ./bench_results) created.
OUT=${OUT:-$PWD/bench_results}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# the server's packages that the machine lacks (the benchmark CLI imports them too), from the carried
# wheels of scripts/device/server_wheels.sh
# (installed once while the machine stays warm: the check sees what an earlier call put there)
SRV_SITE=${TMPDIR:-/tmp}/tokenmill-srv-site
export PYTHONPATH="$PYTHONPATH:$SRV_SITE"
if [ -d .whl/srv ] && ! python -c "import fastapi, uvicorn, orjson, uvloop" 2>/dev/null; then
  python -m pip install -q --no-index --no-deps --target "$SRV_SITE" .whl/srv/*.whl
fi
export TOKENMILL_CACHE=${TOKENMILL_CACHE:-/tmp/tokenmill-cache}
# the commit results record: set it by hand for a tree newer than the copy's git metadata (a warm machine
# reused by a later call has labelled a newer tree with the commit of its first call)
export TOKENMILL_GIT_COMMIT=${TOKENMILL_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"

# For runners that keep their details in $RES (under $WORK) and their tables in $SUMMARY, and define
# pack (the summary of what has finished so far): a line to stderr and $RES/notes.txt, and the common end
# (a last pack, the summary printed, exit with $FAILED).
note() { echo "$*" | tee -a "$RES/notes.txt" >&2; }
finish_run() {
  note "total $((SECONDS - T0)) s"
  pack
  rm -rf "$WORK"
  echo
  echo "==================== summary ($SUMMARY) ===================="
  cat "$SUMMARY"
  exit "$FAILED"
}
