#!/usr/bin/env bash
# Default offline throughput and batch-1 decode of two commits, both presets, in one run on one machine:
# scripts/device/ab_point.py for each model and commit in alternating turns (old, new, old, new), one
# engine per point, then a table of each side's medians and new / old.
#
# Before the device run, put the older commit's source next to this tree (the folder is not tracked):
#   rm -rf .ab_old && mkdir -p .ab_old && git archive "$OLD" src | tar x -C .ab_old
#   grep -q ab_old .git/info/exclude || echo /.ab_old/ >> .git/info/exclude
# then, on the GPU machine, from the repository root (carry .ab_old with the tree):
#   OLD=<old commit> NEW=<this commit> [TURNS=2] [MODELS="qwen3-4b nanbeige4.1-3b"] bash scripts/device/ab_refactor.sh
# About 35 s a point after the presets are materialised (prepare): 8 points with TURNS=2.
set -uo pipefail
source "$(dirname "$0")/env.sh"
OLD=${OLD:?the older commit, whose source is in .ab_old/src}
NEW=${NEW:-$TOKENMILL_GIT_COMMIT}
TURNS=${TURNS:-2}
MODELS=${MODELS:-"qwen3-4b nanbeige4.1-3b"}
[ -d .ab_old/src ] || { echo "no .ab_old/src: see the head of this script" >&2; exit 2; }
base=${PYTHONPATH#"$PWD/src"}    # env.sh put this tree first; each point picks its own source
dir="$OUT/ab_refactor"
mkdir -p "$dir"
rows="$dir/points.jsonl"
: > "$rows"
for m in $MODELS; do
  python -m tokenmill.bench prepare --model "preset:$m" > "$dir/prepare_$m.log" 2>&1 \
    || { echo "prepare $m failed"; tail -5 "$dir/prepare_$m.log"; }
done
for turn in $(seq 1 "$TURNS"); do
  for m in $MODELS; do
    for side in old new; do
      if [ $side = old ]; then src=$PWD/.ab_old/src commit=$OLD; else src=$PWD/src commit=$NEW; fi
      log="$dir/${m}_$side$turn.log"
      TOKENMILL_GIT_COMMIT=$commit PYTHONPATH="$src$base" python scripts/device/ab_point.py "preset:$m" "$side" \
        > "$log" 2>&1
      tail -1 "$log" | grep '^{' >> "$rows" || echo "$m $side$turn FAILED: $(tail -3 "$log")"
      tail -1 "$log"
    done
  done
done
python - "$rows" "$OLD" "$NEW" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
old, new = sys.argv[2], sys.argv[3]
print(f"\n| model | measure | {old} (old) | {new} (new) | new / old |")
print("|---|---|---|---|---|")
for m in dict.fromkeys(r["model"] for r in rows):
    for key, name in (("output_tok_s", "offline output tok/s"), ("step_ms", "batch-1 step ms"),
                      ("graph_replay_ms", "batch-1 graph replay ms")):
        vals = {s: [r[key] for r in rows if r["model"] == m and r["label"] == s] for s in ("old", "new")}
        if not vals["old"] or not vals["new"]:
            print(f"| {m} | {name} | {vals['old']} | {vals['new']} | - |")
            continue
        a, b = statistics.median(vals["old"]), statistics.median(vals["new"])
        fmt = (lambda v: f"{v:,.1f}") if key == "output_tok_s" else (lambda v: f"{v:.4f}")
        print(f"| {m} | {name} | {fmt(a)} ({', '.join(fmt(v) for v in vals['old'])}) | "
              f"{fmt(b)} ({', '.join(fmt(v) for v in vals['new'])}) | {b / a:.4f} |")
PY
