#!/usr/bin/env bash
# Mixed steps (decode rows beside prefill chunks) of two trees on one machine: the attention alone
# (lab/mixed_attention_bench.py, qwen3-4b's heads) and the engine core at fixed concurrency with
# mixed-chat's requests (lab/concurrency_sim.py, with kernel profiles at PROFILE_LEVELS), old then new.
#
# Before the device run, put the older commit's source next to this tree (the folder is not tracked):
#   mkdir -p .ab_old && git archive "$OLD" src | tar x -C .ab_old && echo /.ab_old/ >> .git/info/exclude
# then, on the GPU machine, from the repository root (carry .ab_old with the tree):
#   OLD=<old commit> NEW=<this commit> [MODEL=qwen3-4b] [LEVELS=64,256] bash scripts/device/ab_mixed.sh
# ENGINE_ARGS: more engine arguments for the simulation, key=value (e.g. "quantization=fp8
# kv_cache_dtype=fp8"); PARTS: "attention sim" (default) or either alone.
# Results under $OUT/mixed (sim JSON with the kernel tables, logs); the tables print last.
set -uo pipefail
source "$(dirname "$0")/env.sh"
OLD=${OLD:?the older commit, whose source is in .ab_old/src}
NEW=${NEW:-$TOKENMILL_GIT_COMMIT}
MODEL=${MODEL:-qwen3-4b}
LEVELS=${LEVELS:-64,256}
NUM_PROMPTS=${NUM_PROMPTS:-512}
PROFILE_LEVELS=${PROFILE_LEVELS-64,256}      # "" for no kernel profiles
SIDES=${SIDES:-"old new"}
ENGINE_ARGS=${ENGINE_ARGS:-}
PARTS=${PARTS:-"attention sim"}
[ -d .ab_old/src ] || { echo "no .ab_old/src: see the head of this script" >&2; exit 2; }
base=${PYTHONPATH#"$PWD/src"}
RES="$OUT/mixed"
mkdir -p "$RES"
python -m tokenmill.bench prepare --model "preset:$MODEL" > "$RES/prepare.log" 2>&1 || { tail "$RES/prepare.log"; exit 1; }
src_of() { if [ "$1" = old ]; then echo "$PWD/.ab_old/src"; else echo "$PWD/src"; fi; }
commit_of() { if [ "$1" = old ]; then echo "$OLD"; else echo "$NEW"; fi; }
for side in $SIDES; do
  case " $PARTS " in *" attention "*) ;; *) break ;; esac
  PYTHONPATH="$(src_of $side)$base" python lab/mixed_attention_bench.py --label "$side $(commit_of $side)" \
    >> "$RES/attention.md" 2> "$RES/attention-$side.log" || tail -5 "$RES/attention-$side.log"
done
run=0
for side in $SIDES; do     # a side named again runs again (its rows add to its table)
  case " $PARTS " in *" sim "*) ;; *) break ;; esac
  run=$((run + 1))
  # shellcheck disable=SC2086
  TOKENMILL_GIT_COMMIT=$(commit_of $side) PYTHONPATH="$(src_of $side)$base" python lab/concurrency_sim.py \
    "preset:$MODEL" --levels "$LEVELS" --num-prompts "$NUM_PROMPTS" --profile-levels "$PROFILE_LEVELS" \
    --label "$side-$run" --out "$RES" max_num_seqs=256 $ENGINE_ARGS >> "$RES/sim-$side.md" 2> "$RES/sim-$side-$run.log" \
    || tail -20 "$RES/sim-$side-$run.log"
done
echo "## attention alone, one layer (us per call)"; cat "$RES/attention.md"
echo; echo "## engine at fixed concurrency: label | C | requests | req/s | out tok/s | ms/step | rows/step | tokens/step | computed/step | mixed share"
for side in $(printf '%s\n' $SIDES | awk '!seen[$0]++'); do echo "### $side $(commit_of $side)"; cat "$RES/sim-$side.md"; done
