"""The sampling kernel's launch shape on the GPU: `kernels/sampling._sample_kernel` at each (BLOCK, num_warps)
over 256 rows (and 64) of bf16 logits, vocabularies of qwen3-4b (151,936) and nanbeige4.1-3b (166,144).

One program walks one row, so a step's sampling takes as long as its slowest row: a row whose race winner
falls outside the nucleus bisects for the cut-off, one pass over the row a probe, while the others stop
after two passes. The launch shape sets how many bytes a program has in flight each iteration of a pass.

Logits are N(0, s^2): s = 1 ("flat", as random-weight presets give) or s = 4 ("peaked"); temperature 0.8,
seeded, top_p 0.95 (every row checks its winner; some bisect) or top_p 1 (the race alone, pass 1).

Columns: gpu us per call (CUDA events, the calls enqueued behind a GPU sleep), x of the shipped shape, and
agree % (tokens equal to the shipped shape's; the race's running maximum is rescaled at block boundaries,
so only float rounding of near-ties can differ). Writes $OUT/sampler_sweep.json and .md; table printed last.

Usage: python lab/sampler_sweep.py [--out DIR] [--iters 20]
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

from sampler_bench import time_gpu
from tokenmill.layers.kernels import sampling
from tokenmill.runner.sampling_rows import ROW
from tokenmill.runner.sampling_tensors import SamplingTensors

SHAPES = [(2048, 8), (2048, 16), (4096, 8), (4096, 16), (8192, 8), (8192, 16), (8192, 32), (16384, 16),
          (16384, 32)]
SHIPPED = sampling.RACE_SHAPE       # the shape before batches with top-k/top-p took FILTER_SHAPE


def params(rows: int, vocab: int, top_p: float) -> tuple[torch.Tensor, ...]:
    packed = np.zeros(rows, dtype=ROW)
    packed["temperature"], packed["top_k"], packed["top_p"], packed["repetition_penalty"] = 0.8, vocab, top_p, 1.0
    packed["seed"], packed["position"], packed["seeded"] = np.arange(rows) * 7919 + 3, np.arange(rows) % 97, 1
    return SamplingTensors.from_rows(packed, vocab, torch.device("cuda")).kernel_params


def run(logits: torch.Tensor, kp: tuple, block: int, warps: int) -> torch.Tensor:
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    temperature, top_k, top_p, min_p, seeds, positions = kp
    sampling._sample_kernel[(rows,)](logits, logits.stride(0), out, vocab, temperature, temperature.stride(0),
                                     top_k, top_k.stride(0), top_p, top_p.stride(0), min_p, min_p.stride(0),
                                     seeds, seeds.stride(0), positions, positions.stride(0), BLOCK=block,
                                     MAX_PROBES=sampling.MAX_PROBES, RETRIES=sampling.RETRIES, LOG2E=sampling._LOG2E,
                                     num_warps=warps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for vocab in (151936, 166144):
        for scale_name, scale in (("flat", 1.0), ("peaked", 4.0)):
            for rows in (64, 256):
                logits = (torch.randn(rows, vocab, device="cuda", generator=g) * scale).to(torch.bfloat16)
                for top_p in (0.95, 1.0):
                    kp = params(rows, vocab, top_p)
                    ref = run(logits, kp, *SHIPPED)
                    base = None
                    for block, warps in [SHIPPED] + [s for s in SHAPES if s != SHIPPED]:
                        us, _ = time_gpu(lambda: run(logits, kp, block, warps), args.iters)
                        got = run(logits, kp, block, warps)
                        base = us if base is None else base
                        results.append(dict(vocab=vocab, logits=scale_name, rows=rows, top_p=top_p, block=block,
                                            warps=warps, gpu_us=us, x_shipped=base / us,
                                            agree=float((got == ref).float().mean())))
                        print(results[-1], flush=True)
    with open(os.path.join(args.out, "sampler_sweep.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = ["| vocab | logits | rows | top_p | BLOCK | warps | gpu us | x shipped | agree % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['vocab']} | {r['logits']} | {r['rows']} | {r['top_p']} | {r['block']} | {r['warps']} | "
                     f"{r['gpu_us']:.1f} | {r['x_shipped']:.2f} | {100 * r['agree']:.1f} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "sampler_sweep.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
