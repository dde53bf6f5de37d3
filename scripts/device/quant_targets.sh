#!/usr/bin/env bash
# The quantized-serving speed targets of one model against bf16 on one H200 (about 8-9 minutes a model: near
# one call's 10-minute limit, so PARTS=decode in one call and PARTS="default long" in the next is safer),
# from the repository root, with .whl carried (bash scripts/device/server_wheels.sh):
#   decode   batch-1 ms/token, bf16 and FP8 weights (scripts/device/bench_fp8.py: one request, 32 in /
#            256 out), and AWQ 4-bit g128 (scripts/device/bench_w4.py decode, 128 out) where AWQ=1
#   default  `tokenmill bench throughput`, 256 requests, 100-1,024 in / 100-1,024 out, seed 0: bf16, FP8
#            weights, FP8 weights and KV cache
#   long     64 requests, 6,000-8,000 in / 64-256 out: bf16, FP8 weights and KV cache
# Each run is its own process, one after the other; the table (each figure against bf16's in this call) is
# printed last and saved as $OUT/SUMMARY-quant-<model>.md, the runs' logs and JSON in
# $OUT/quant-<model>-details.tgz.
#   OUT=/path MODEL=qwen3-4b [PARTS="decode default long"] [AWQ=1] bash scripts/device/quant_targets.sh
set -uo pipefail
MODEL=${MODEL:-qwen3-4b}
PARTS=${PARTS:-"decode default long"}
AWQ=${AWQ:-1}
source "$(dirname "$0")/env.sh"
FAILED=0
python -m tokenmill.bench prepare --model "preset:$MODEL" > "$OUT/prepare-$MODEL.log" 2>&1 || FAILED=1

run_throughput() {   # run_throughput NAME WORKLOAD-ARGS... -- ENGINE-ARGS...
  local name=$1; shift
  local t0=$SECONDS
  # shellcheck disable=SC2068
  python -m tokenmill.bench throughput --model "preset:$MODEL" --backend tokenmill --dataset random --seed 0 \
    --no-progress $@ --output-dir "$OUT" --name "quant-$MODEL-$name" > "$OUT/quant-$MODEL-$name.log" 2>&1 \
    || { FAILED=1; echo "$name FAILED" >&2; tail -5 "$OUT/quant-$MODEL-$name.log" >&2; }
  echo "$name: $((SECONDS - t0)) s" >&2
}

for part in $PARTS; do
  case $part in
    decode)
      for q in none fp8; do
        python scripts/device/bench_fp8.py run --model "preset:$MODEL" --quantization $q --decode-only --out "$OUT" \
          > "$OUT/quant-$MODEL-decode-$q.log" 2>&1 || { FAILED=1; tail -5 "$OUT/quant-$MODEL-decode-$q.log" >&2; }
        mv "$OUT/fp8_$q.json" "$OUT/quant-$MODEL-decode-$q.json" 2>/dev/null
      done
      if [ "$AWQ" = 1 ]; then
        W4_MODELS=$MODEL python scripts/device/bench_w4.py decode --out "$OUT" > "$OUT/quant-$MODEL-decode-awq.log" 2>&1 \
          || { FAILED=1; tail -5 "$OUT/quant-$MODEL-decode-awq.log" >&2; }
        mv "$OUT/w4_decode.json" "$OUT/quant-$MODEL-decode-awq.json" 2>/dev/null
      fi ;;
    default)
      shape="--num-prompts 256 --input-len-range 100,1024 --output-len-range 100,1024"
      run_throughput default-bf16 $shape
      run_throughput default-fp8w $shape --quantization fp8
      run_throughput default-fp8wkv $shape --quantization fp8 --kv-cache-dtype fp8 ;;
    long)
      shape="--num-prompts 64 --input-len-range 6000,8000 --output-len-range 64,256"
      run_throughput long-bf16 $shape
      run_throughput long-fp8wkv $shape --quantization fp8 --kv-cache-dtype fp8 ;;
    *) echo "unknown part $part" >&2; FAILED=1 ;;
  esac
done

python - "$OUT" "$MODEL" <<'EOF' | tee "$OUT/SUMMARY-quant-$MODEL.md"
import json, os, sys
out, model = sys.argv[1], sys.argv[2]

def load(name):
    path = os.path.join(out, f"quant-{model}-{name}.json")
    return json.load(open(path)) if os.path.exists(path) else None

print(f"## Quantized serving against bf16: preset:{model}, commit {os.environ.get('TOKENMILL_GIT_COMMIT', '?')}\n")
print("| figure | bf16 | quantized | ratio | target | floors' ratio | measured / floor, bf16 -> quantized |")
print("|---|---|---|---|---|---|---|")
bf16, fp8 = load("decode-none"), load("decode-fp8")
if bf16 and fp8:
    print(f"| batch-1 decode ms/token, FP8 weights | {bf16['decode_ms_per_token']:.3f} | "
          f"{fp8['decode_ms_per_token']:.3f} | {bf16['decode_ms_per_token'] / fp8['decode_ms_per_token']:.2f}x faster | <= 1.4 ms |")
awq = load("decode-awq")
if awq:
    rows = {r["model"]: r for r in awq if "ms_per_token" in r}
    a, b = rows.get(f"{model} awq g128"), rows.get(f"{model} bf16")
    if a and b:
        print(f"| batch-1 decode ms/token, AWQ 4-bit g128 | {b['ms_per_token']:.3f} | {a['ms_per_token']:.3f} | "
              f"{b['ms_per_token'] / a['ms_per_token']:.2f}x faster | <= 1.0 ms |")
for workload, variants in (("default", (("fp8w", "FP8 weights", ">= 1.25x"), ("fp8wkv", "FP8 weights + KV", ">= 1.5x"))),
                           ("long", (("fp8wkv", "FP8 weights + KV", ">= 1.3x"),))):
    base = load(f"{workload}-bf16")
    base_tok = base["results"][0]["output_tok_s"] if base else None
    if base is None and not any(load(f"{workload}-{name}") for name, _, _ in variants):
        continue        # a part not run in this call
    for name, label, target in variants:
        got = load(f"{workload}-{name}")
        tok = got["results"][0]["output_tok_s"] if got else None
        ratio = f"**{tok / base_tok:.3f}x**" if tok and base_tok else "(failed)"
        # each run's floor is its own weights' and cache's (tokenmill.bench.roofline)
        floors = (f"{base['roofline']['floor_s'] / got['roofline']['floor_s']:.3f}x | "
                  f"{base['results'][0]['measured_over_floor']:.2f} -> {got['results'][0]['measured_over_floor']:.2f}"
                  if tok and base_tok else "- | -")
        print(f"| {workload} workload output tok/s, {label} | {base_tok or 0:,.0f} | {tok or 0:,.0f} | {ratio} | {target} | {floors} |")
print("\ndecode: one request, 32 in / 256 out (bench_fp8.py; AWQ: bench_w4.py, 128 out); default: 256 requests, "
      "100-1,024 in / 100-1,024 out; long: 64 requests, 6,000-8,000 in / 64-256 out; seed 0, ignore_eos")
EOF
# the details in one archive beside the summary (the device tool brings back a limited number of files)
(cd "$OUT" && tar czf "quant-$MODEL-details.tgz" --remove-files $(ls "quant-$MODEL"-* "prepare-$MODEL.log" 2>/dev/null \
  | grep -v "\.tgz$"))
exit $FAILED
