"""GPTQ's time on SmolLM2-135M-Instruct (the real-weights tests' model and calibration), one thread: the
whole of `gptq_model` (4-bit g128, output targets) or `gptq_fp8_model`, and the functions inside it. The
weights go to /tmp/gptq-time/{w4|fp8}-TAG.pt, to compare two trees' results.

    PYTHONPATH=src python lab/gptq_time.py {w4|fp8} TAG
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_real_quantized import GGUF, calibration_ids, write_plain_smollm2  # noqa: E402

from tokenmill.config import ModelConfig  # noqa: E402
from tokenmill.engine.tokenizer import Tokenizer  # noqa: E402
from tokenmill.quant import gptq  # noqa: E402
from tokenmill.quant.quantize import min_zero  # noqa: E402
from tokenmill.runner.loader import load_model  # noqa: E402

OUT = "/tmp/gptq-time"


def main(what: str, tag: str) -> None:
    torch.set_num_threads(1)
    path = os.path.join(OUT, "plain")
    if not os.path.exists(os.path.join(path, "config.json")):
        write_plain_smollm2(path)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    model = load_model(path, ModelConfig.from_hf(hf), torch.device("cpu"), torch.float32)
    calibration = calibration_ids(Tokenizer(GGUF).hf, 2048)
    spent: dict[str, float] = {}

    def timed(name, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return run
    for name in ("gptq_columns", "output_target", "clipped_grid"):
        setattr(gptq, name, timed(name, getattr(gptq, name)))
    start = time.perf_counter()
    if what == "w4":
        out = gptq.gptq_model(model, calibration, 128, sym=False, min_zero=min_zero("gptq"))
    else:
        out = gptq.gptq_fp8_model(model, calibration)
    total = time.perf_counter() - start
    print(what, tag, f"total {total:.2f} s", {k: round(v, 2) for k, v in spent.items()})
    torch.save(out, os.path.join(OUT, f"{what}-{tag}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
