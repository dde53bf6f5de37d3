#!/usr/bin/env bash
# lab/fp8_w8a16.py on one H200, from the repository root (.whl carried: bash scripts/device/server_wheels.sh):
#   bench   qwen3-4b's four products at 64-2,048 rows: bf16, the shipped fp8_linear and W8A16 at each tile,
#           per channel and 128 x 128 blocks (about 3 minutes) -> $OUT/fp8_w8a16.md
#   engine  the default offline workload: bf16, then FP8 shipped and FP8 with products of 33-$ROWS rows
#           through W8A16, alternating twice (about 75 s a run) -> ROW lines in $OUT/w8a16_engine.txt
# Two calls fit the 10-minute limit: PARTS=bench, then PARTS=engine.
#   OUT=/path PARTS="bench engine" [ROWS=512] [KV=auto] bash scripts/device/w8a16_check.sh
set -uo pipefail
PARTS=${PARTS:-"bench engine"}
ROWS=${ROWS:-512}
KV=${KV:-auto}
source "$(dirname "$0")/env.sh"
status=0
for part in $PARTS; do
  t0=$SECONDS
  case $part in
    bench)
      python lab/fp8_w8a16.py bench --out "$OUT" > "$OUT/w8a16_bench.log" 2>&1 || { status=1; tail -20 "$OUT/w8a16_bench.log"; } ;;
    engine)
      python lab/fp8_w8a16.py engine --bf16 2>&1 | grep -E "^ROW|Error" | tee -a "$OUT/w8a16_engine.txt"
      for r in 0 "$ROWS" "$ROWS" 0; do
        python lab/fp8_w8a16.py engine --w8a16 "$r" --kv "$KV" 2>&1 | grep -E "^ROW|Error" | tee -a "$OUT/w8a16_engine.txt"
      done ;;
    *) echo "unknown part $part" >&2; status=1 ;;
  esac
  echo "part $part: $((SECONDS - t0)) s"
done
[ -f "$OUT/fp8_w8a16.md" ] && cat "$OUT/fp8_w8a16.md"
[ -f "$OUT/w8a16_engine.txt" ] && cat "$OUT/w8a16_engine.txt"
echo "commit $TOKENMILL_GIT_COMMIT"
exit $status
