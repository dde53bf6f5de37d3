"""SmolLM2-135M (the Quickstart's model) decoding a few sequences at once on the CPU, one thread: ms per
step at 1, 2, 4 and 8 sequences (16-token prompts, 64 tokens out, eos ignored), for source trees in turns.

    mkdir -p .ab_old && git archive <commit> src | tar x -C .ab_old
    python lab/cpu_few_rows.py old=.ab_old/src new=src --turns 2
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", help="name=path of a source tree")
    ap.add_argument("--turns", type=int, default=1)
    args = ap.parse_args()
    for turn in range(args.turns):
        for spec in args.trees:
            name, tree = spec.split("=", 1)
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS="1")
            r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
            ms = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"turn {turn + 1} {name}: " + "  ".join(f"{b} seqs {v:.1f} ms" for b, v in ms.items()), flush=True)


if __name__ == "__main__":
    main()
