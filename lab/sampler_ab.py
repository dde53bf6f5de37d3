"""The sampling kernel of one source tree (PYTHONPATH) at its shipped launch shapes, over the rows a sampled
decode step hands it: 64 or 256 rows of bf16 logits, qwen3-4b's and nanbeige4.1-3b's vocabularies, N(0, s^2)
logits with s = 1 ("flat", as random-weight presets give) or 4 ("peaked"), temperature 0.8, seeded, and
top_p 0.95, top_p 0.95 with min_p 0.05, top_k 50, or the race alone. Run once per tree to compare kernels:

    PYTHONPATH=src python lab/sampler_ab.py --label new

Prints one row per case: device us per call (`sampler_bench.time_gpu`) and a checksum of the tokens (equal
between trees that draw the same tokens).
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from sampler_bench import time_gpu
from tokenmill.runner.sampling_rows import ROW
from tokenmill.runner.sampling_tensors import SamplingTensors

CASES = {"top_p 0.95": dict(top_p=0.95), "top_p 0.95, min_p 0.05": dict(top_p=0.95, min_p=0.05),
         "top_k 50": dict(top_k=50), "race only": dict()}


def params(rows: int, vocab: int, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0) -> SamplingTensors:
    packed = np.zeros(rows, dtype=ROW)
    packed["temperature"], packed["top_p"], packed["min_p"], packed["repetition_penalty"] = 0.8, top_p, min_p, 1.0
    packed["top_k"] = top_k or vocab
    packed["seed"], packed["position"], packed["seeded"] = np.arange(rows) * 7919 + 3, np.arange(rows) % 97, 1
    return SamplingTensors.from_rows(packed, vocab, torch.device("cuda"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    from tokenmill.layers.kernels import sampling
    g = torch.Generator(device="cuda").manual_seed(0)
    for vocab in (151936, 166144):
        for name, scale in (("flat", 1.0), ("peaked", 4.0)):
            for rows in (64, 256):
                logits = (torch.randn(rows, vocab, device="cuda", generator=g) * scale).to(torch.bfloat16)
                for case, kw in CASES.items():
                    t = params(rows, vocab, **kw)
                    filtered = t.top_k is not None or t.top_p is not None

                    def run():
                        return sampling.sample(logits, *t.kernel_params, filtered=filtered)
                    us, _ = time_gpu(run, args.iters)
                    tokens = run()
                    print(f"| {args.label} | {vocab} | {name} | {rows} | {case} | {us:.1f} us | "
                          f"{int(tokens.sum())} |", flush=True)


if __name__ == "__main__":
    main()
