"""A/B of the mixed-step CUDA graph buckets on one GPU: the short offline workload (2,048 requests, 50-300
in / out, max_num_seqs 512) with mixed-step graphs of up to every running sequence (the product) against
graphs of at most 64 sequences (the buckets before 4a029fe; larger mixed steps then run eagerly), each
variant in its own process, in turn, twice.

    PYTHONPATH=src python lab/graph_bucket_ab.py [--model preset:qwen3-4b] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def run_one(model: str, cap: int | None, num: int) -> dict:
    import numpy as np

    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.datasets import random_requests
    from tokenmill.models.presets import resolve_model_path
    from tokenmill.runner import cuda_graphs

    if cap is not None:
        keys = cuda_graphs.CudaGraphRunner._keys

        def capped(self):
            return [k for k in keys(self) if k[0] == "decode" or k[2] <= cap]
        cuda_graphs.CudaGraphRunner._keys = capped
    path = resolve_model_path(model)
    llm = LLM(path, max_num_seqs=512)
    vocab = llm.engine.model_config.vocab_size
    reqs = random_requests(num, (50, 300), (50, 300), vocab, seed=0)
    llm.generate([[1] * 16], SamplingParams(max_tokens=4, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"cap": cap, "elapsed_s": elapsed, "output_tok_s": tokens / elapsed,
            "graphs": len(llm.engine.runner.graphs), "checksum": int(np.sum([sum(o.outputs[0].token_ids[:4]) for o in outs]))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="preset:qwen3-4b")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=2048)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        cap = None if args.worker == "all" else int(args.worker)
        print(json.dumps(run_one(args.model, cap, args.num_prompts)))
        return
    rows = []
    for r in range(args.rounds):
        for variant in ("all", "64"):
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--num-prompts",
                                  str(args.num_prompts), "--worker", variant], capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["round"] = r
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| round | mixed graphs up to | graphs | elapsed s | output tok/s | checksum |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        cap = "every sequence" if row["cap"] is None else f"{row['cap']} sequences"
        print(f"| {row['round']} | {cap} | {row['graphs']} | {row['elapsed_s']:.2f} | {row['output_tok_s']:,.0f} | "
              f"{row['checksum']} |")


if __name__ == "__main__":
    main()
