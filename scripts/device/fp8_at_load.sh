#!/usr/bin/env bash
# FP8 weights quantized at load on the GPU against the CPU quantizer's bytes: how often CUDA's division by a
# Python number (a product with the reciprocal) and by a tensor differ from the CPU's division, then the GPU
# tests that hold the quantizer and a served Granite checkpoint to the CPU's bytes. From the repository root:
#   OUT=/path bash scripts/device/fp8_at_load.sh        # carry .whl; $OUT/fp8_at_load.txt
set -uo pipefail
source "$(dirname "$0")/env.sh"
status=0
python - <<'PY' 2>&1 | tee "$OUT/fp8_at_load.txt"
import torch
torch.manual_seed(0)
amax = torch.rand(1 << 22) * torch.logspace(-6, 2, 1 << 22)
cpu = amax / 448.0
for name, gpu in (("by a Python number", amax.cuda() / 448.0),
                  ("by a tensor of 448", amax.cuda() / torch.full_like(amax.cuda(), 448.0))):
    print(f"amax / 448 on the GPU {name}: {int((gpu.cpu() != cpu).sum())} of {amax.numel()} differ from the CPU's")
PY
python -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8.py tests/test_granite.py 2>&1 \
  | tee -a "$OUT/fp8_at_load.txt" | tail -15 || status=1
exit $status
