"""SmolLM2-135M (the Quickstart's model) decoding a few sequences at once on the CPU, one thread: ms per
step at 1, 2, 4 and 8 sequences (16-token prompts, 64 tokens out, eos ignored), for source trees in turns.

    mkdir -p .ab_old && git archive <commit> src | tar x -C .ab_old
    python lab/cpu_few_rows.py old=.ab_old/src new=src --turns 2

`--products`: the two forms of one product, F.linear (x W^T) against W x^T, for 1-16 rows of weights of
SmolLM2's and qwen3-4b's shapes, one thread, float32, ms.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from tokenmill import LLM, SamplingParams
from tokenmill.models.default import smollm2_gguf
llm = LLM(smollm2_gguf(), device="cpu", dtype="float32", num_kv_blocks=256)
out = {}
for batch in (1, 2, 4, 8):
    prompts = [[100 + i + j for j in range(16)] for i in range(batch)]
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    out[batch] = (time.perf_counter() - t) / 64 * 1e3
print(json.dumps(out))
"""


def products():
    import time

    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)

    def best_ms(f, n=4, reps=5):
        f()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(n):
                f()
            best = min(best, (time.perf_counter() - t) / n * 1e3)
        return best

    for out_f, in_f in ((1536, 576), (8192, 576), (32768, 576), (49152, 576), (19456, 2560), (151936, 2560)):
        w = torch.randn(out_f, in_f)
        line = f"{out_f}x{in_f}:"
        for rows in (1, 2, 4, 8, 16):
            x = torch.randn(rows, in_f)
            line += f"  {rows} rows {best_ms(lambda: F.linear(x, w)):.2f} / {best_ms(lambda: (w @ x.t()).t()):.2f}"
        print(line, "ms (x W^T / W x^T)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="*", help="name=path of a source tree")
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--products", action="store_true")
    args = ap.parse_args()
    if args.products:
        return products()
    for turn in range(args.turns):
        for spec in args.trees:
            name, tree = spec.split("=", 1)
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS="1")
            r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
            ms = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"turn {turn + 1} {name}: " + "  ".join(f"{b} seqs {v:.1f} ms" for b, v in ms.items()), flush=True)


if __name__ == "__main__":
    main()
