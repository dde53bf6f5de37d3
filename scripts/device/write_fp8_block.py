"""A preset's weights written as Qwen's block-wise FP8 checkpoint (`quant_method: fp8`, 128 x 128 blocks,
`weight_scale_inv`), the format Qwen3-4B-FP8 ships in, with the preset's tokenizer files beside it.

    python scripts/device/write_fp8_block.py preset:qwen3-4b DIR
"""
import glob
import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file

from tokenmill.models.presets import resolve_model_path
from tokenmill.quant import fp8

src, dst = resolve_model_path(sys.argv[1]), sys.argv[2]
if not os.path.isfile(os.path.join(dst, "config.json")):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = {}
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        state.update(load_file(path, device=device))
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    fp8.write_checkpoint(dst, {k: v.cpu() for k, v in state.items()}, hf, "fp8")
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "generation_config", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(os.path.join(src, name), dst)
print(dst)
