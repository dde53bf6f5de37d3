#!/usr/bin/env bash
# Batch-1 decode on the GPU machine, from the repository root:
#   tests  the gpu-marked kernel and engine tests
#   gemv   scripts/device/gemv_bench.py: single-token product kernels against cuBLAS, per layer shape;
#          the fastest tile per shape goes to $OUT/gemv_configs.json (and /tmp/gemv_configs.json)
#   e2e    scripts/device/profile_decode.py at batch 1 for each VARIANTS entry GEMV,PDL[,ATTN]: cuBLAS (0)
#          or the fused single-token kernels (1) (TOKENMILL_GEMV); programmatic dependent launch off (0),
#          the next kernel triggered after (1) or before (2) each wait (TOKENMILL_PDL); decode attention
#          as prologue, split-K kernel and merge (0) or as one kernel (1, the default)
#          (TOKENMILL_FUSED_DECODE); with GEMV_VARIANTS (profile_decode.py --gemv-variants, a JSON list),
#          each run also times the batch-1 graph under each variant of the product tiles, in turns;
#          with TIMELINE=1 also profile_decode.py --timeline (timeline_report.txt in each run's folder)
#   smem   scripts/device/gemv_smem.py: each product with shared-memory tiles (gemv_smem: whole row
#          blocks copied before the wait) against its current tile, for SMEM_MODELS (default
#          qwen3-4b) and SMEM_TILES (default the script's list)
#   timeline  profile_decode.py --timeline at batch 1: device events of a graph replay and of engine
#          steps ($OUT/timeline/timeline_<model>.json; scripts/device/timeline_report.py reads them)
#   head   scripts/device/head_bench.py: final norm + vocabulary head + greedy argmax, engine path
#          against single-token variants, for HEAD_MODELS (default qwen3-4b)
#   OUT=/path STAGES="tests gemv e2e" MODELS="qwen3-4b nanbeige4.1-3b" bash scripts/device/decode_latency.sh
set -uo pipefail
STAGES=${STAGES:-"tests gemv e2e"}
MODELS=${MODELS:-"qwen3-4b nanbeige4.1-3b"}
VARIANTS=${VARIANTS:-"0,0,0 1,2,0 1,2,1"}
source "$(dirname "$0")/env.sh"
status=0
for stage in $STAGES; do
  case $stage in
    tests)
      python -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_engine.py 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -6 || status=1 ;;
    gemv)
      python scripts/device/gemv_bench.py --out "$OUT" --models "$(echo $MODELS | tr ' ' ',')" 2>&1 \
        | tee "$OUT/gemv_bench.log" | grep -v '^{' || status=1 ;;
    smem)
      python scripts/device/gemv_smem.py --out "$OUT" --models "$(echo ${SMEM_MODELS:-qwen3-4b} | tr ' ' ',')" \
        ${SMEM_TILES:+--tiles "$SMEM_TILES"} 2>&1 \
        | tee "$OUT/gemv_smem.log" | grep -v '^{' || status=1 ;;
    timeline)
      for m in $MODELS; do
        python scripts/device/profile_decode.py --model "preset:$m" --batch-sizes 1 --prefill-lens "" \
          --output-len 128 --timeline --out "$OUT/timeline" > "$OUT/timeline_$m.log" 2>&1 \
          || { status=1; tail -20 "$OUT/timeline_$m.log"; }
        python scripts/device/timeline_report.py "$OUT/timeline/timeline_$m.json" | tee -a "$OUT/timeline_$m.log"
      done ;;
    head)
      python scripts/device/head_bench.py --out "$OUT" --models "$(echo ${HEAD_MODELS:-qwen3-4b} | tr ' ' ',')" \
        2>&1 | tee "$OUT/head_bench.log" | grep -v '^{' || status=1 ;;
    e2e)
      configs=${TOKENMILL_GEMV_CONFIGS:-}
      [ -z "$configs" ] && [ -f /tmp/gemv_configs.json ] && configs=/tmp/gemv_configs.json
      for m in $MODELS; do
        for v in $VARIANTS; do
          IFS=, read -r g p a <<< "$v"
          a=${a:-1}
          dir="$OUT/e2e_${m}_gemv${g}_pdl${p}_attn${a}"
          TOKENMILL_GEMV=$g TOKENMILL_PDL=$p TOKENMILL_FUSED_DECODE=$a TOKENMILL_GEMV_CONFIGS=$configs \
            python scripts/device/profile_decode.py --model "preset:$m" --batch-sizes 1 --prefill-lens "" \
            --output-len 128 --out "$dir" ${GEMV_VARIANTS:+--gemv-variants "$GEMV_VARIANTS"} \
            ${TIMELINE:+--timeline} > "$dir.log" 2>&1 || { status=1; tail -20 "$dir.log"; }
          [ -f "$dir/timeline_$m.json" ] && python scripts/device/timeline_report.py "$dir/timeline_$m.json" \
            > "$dir/timeline_report.txt"
        done
      done
      python - "$OUT" <<'PY'
import glob, json, os, sys
print("\n| model | single-token kernels | PDL mode | one-kernel attention | step ms | graph replay ms "
      "| kernels/step |")
print("|---|---|---|---|---|---|---|")
for d in sorted(glob.glob(os.path.join(sys.argv[1], "e2e_*"))):
    f = glob.glob(os.path.join(d, "profile_*.json"))
    if not os.path.isdir(d) or not f:
        continue
    r = json.load(open(f[0]))["decode"][0]
    g, rest = d.rsplit("_gemv", 1)[1].split("_pdl")
    p, a = rest.split("_attn")
    print(f"| {r['model']} | {'yes' if g == '1' else 'no (cuBLAS)'} | {p} | {'yes' if a == '1' else 'no'} | "
          f"{r['step_ms']:.3f} | {r['graph_replay_ms']:.3f} | {r['kernels_per_step']:.0f} |")
rows = [(os.path.basename(d), v) for d in sorted(glob.glob(os.path.join(sys.argv[1], "e2e_*")))
        for f in glob.glob(os.path.join(d, "profile_*.json")) for v in json.load(open(f)).get("gemv_variants", [])]
if rows:
    print("\n| run | product variant | batch-1 graph replay ms (median of turns) | turns |")
    print("|---|---|---|---|")
    for run, v in rows:
        print(f"| {run} | {v['variant']} | {v['graph_replay_ms']:.3f} | {' '.join(f'{t:.3f}' for t in v['all_ms'])} |")
PY
      ;;
  esac
done
exit $status
