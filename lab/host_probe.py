"""The offline engine's host work alone: `LLM.generate` on the bundled model with the model's forward and
the sampler replaced by constants (each sampled row gets a fixed word of the tokenizer), so what is timed
is the scheduler, input preparation, the core's processing of tokens and the frontend (detokenization,
output assembly): the work that must fit under each device step for the GPU never to wait. By default
the short offline workload's shape: requests of 50-300 prompt tokens and 50-300 output tokens (eos
ignored), `--max-num-seqs 512`, prefix caching on; the default workload's is `--num-prompts 256
--len-range 100,1024 --max-num-seqs 256`.

    python lab/host_probe.py [--num-prompts 2048] [--len-range 50,300] [--max-num-seqs 512] [--temperature T]
        [--profile]

Prints requests, tokens, steps, seconds, ms per step and us per output token (and with --profile, the top
of cProfile by own time).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.runner import model_runner
from tokenmill.runner.sampler import SamplerOutput

_IDS = 300 + torch.arange(4096) % 1000       # words of the bundled tokenizer


def _no_forward(self, inp, prev_tokens):
    return None, len(inp.sample_rows) or None      # the sampler below takes the row count for logits


def _no_sample(rows, tensors, greedy=None):
    return SamplerOutput(token_ids=_IDS[:rows])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=2048)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--len-range", default="50,300", help="prompt and output lengths, uniform (lo,hi)")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0, help="above 0: sampled requests (top_p 0.95), "
                    "whose per-row sampling parameters the runner builds each step")
    args = ap.parse_args()
    model_runner.ModelRunner._eager_forward = _no_forward
    model_runner.sample = _no_sample
    model = os.path.join(os.path.dirname(__file__), "..", "src", "tokenmill", "assets", "tiny")
    lo, hi = (int(x) for x in args.len_range.split(","))
    llm = LLM(model, max_num_seqs=args.max_num_seqs, max_model_len=min(2 * hi + 16, 2048),
              enable_prefix_caching=True)
    rng = random.Random(0)
    n = args.num_prompts
    prompts = [{"prompt_token_ids": [rng.randrange(300, 1300) for _ in range(rng.randint(lo, hi))]}
               for _ in range(n)]
    sampled = dict(temperature=args.temperature, top_p=0.95) if args.temperature > 0 else dict(temperature=0)
    params = [SamplingParams(max_tokens=rng.randint(lo, hi), ignore_eos=True, **sampled) for _ in range(n)]
    steps = 0
    step = llm.engine.step

    def counted():
        nonlocal steps
        steps += 1
        return step()
    llm.engine.step = counted
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    outs = llm.generate(prompts, params)
    if prof:
        prof.disable()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{n} requests, {tokens} tokens, {steps} steps, {dt:.2f} s, {1e3 * dt / steps:.3f} ms/step, "
          f"{1e6 * dt / tokens:.2f} us/token")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumtime").print_stats(40)


if __name__ == "__main__":
    main()
