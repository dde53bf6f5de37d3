#!/usr/bin/env bash
# Batch-1 decode latency of two commits on one machine, in alternating turns (old, new, old, new...), so
# the difference is not a machine-to-machine one: env_ab.sh with each commit's source as a side's
# settings (the engine's ms per step and the decode graph's replay).
#
# Before the device run, put the older commit's source next to this tree (the folder is not tracked):
#   rm -rf .ab_old && mkdir -p .ab_old && git archive "$OLD" src | tar x -C .ab_old
#   grep -q ab_old .git/info/exclude || echo /.ab_old/ >> .git/info/exclude
# then, on the GPU machine, from the repository root (carry .ab_old with the tree):
#   OLD=<old commit> NEW=<this commit> [TURNS=2] [MODELS="qwen3-4b nanbeige4.1-3b"] bash scripts/device/ab_latency.sh
# Prints one table row per run; each run's profile and log under $OUT/ab_latency.
set -uo pipefail
source "$(dirname "$0")/env.sh"
OLD=${OLD:?the older commit, whose source is in .ab_old/src}
NEW=${NEW:-$TOKENMILL_GIT_COMMIT}
[ -d .ab_old/src ] || { echo "no .ab_old/src: see the head of this script" >&2; exit 2; }
base=${PYTHONPATH#"$PWD/src"}    # env.sh put this tree first; each run picks its own source
ENV_A="TOKENMILL_GIT_COMMIT=$OLD PYTHONPATH=$PWD/.ab_old/src$base" \
ENV_B="TOKENMILL_GIT_COMMIT=$NEW PYTHONPATH=$PWD/src$base" \
NAME_A=old NAME_B=new LABEL_A=$OLD LABEL_B=$NEW LABEL_HEADER=commit SUBDIR=ab_latency \
MODELS=${MODELS:-"qwen3-4b nanbeige4.1-3b"} OUT=$OUT exec bash "$(dirname "$0")/env_ab.sh"
