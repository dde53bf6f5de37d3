#!/usr/bin/env bash
# Trains the bundled tiny model on the GPU machine (the command of docs/TINY_MODEL.md, with early stopping:
# validation every 100 steps, the best weights kept, stop after 3 evaluations without improvement) and packs the
# result for the trip back: $OUT/tiny-gpu.tar.gz.part-* (16 MiB pieces) and $OUT/tiny_train.log.
#   OUT=/path MAX_MINUTES=6 bash scripts/device/train_tiny.sh
# Back here: cat tiny-gpu.tar.gz.part-* | tar xz -C /tmp   (gives /tmp/tiny-gpu)
set -uo pipefail
MAX_MINUTES=${MAX_MINUTES:-6}
source "$(dirname "$0")/env.sh"
export TOKENIZERS_PARALLELISM=true   # the tokenizer is trained here, on every core
rm -rf /tmp/tiny-gpu
python scripts/train_tiny.py --out /tmp/tiny-gpu --device cuda --with-tests \
    --vocab-size 8192 --hidden-size 384 --intermediate-size 1024 --num-layers 6 --num-heads 6 \
    --num-kv-heads 2 --head-dim 64 --seq-len 512 --batch-size 32 --steps 1500 --warmup 100 --lr 2e-3 \
    --log-every 100 --eval-batches 16 --eval-every 100 --patience 3 --max-minutes "$MAX_MINUTES" \
    > "$OUT/tiny_train.log" 2>&1
status=$?
python -c "import sys; print(sys.version)" >> "$OUT/tiny_train.log"
tar czf - -C /tmp tiny-gpu | split -b 15M - "$OUT/tiny-gpu.tar.gz.part-"
exit $status
