"""A/B of the mixed-step CUDA graph buckets on one GPU: the short offline workload (2,048 requests, 50-300
in / out, max_num_seqs 512), each variant in its own process, in turn, `--rounds` times. A variant
replaces the token buckets of the mixed-step graphs (`CudaGraphRunner._keys`) or caps them:

- shipped: the tree's own buckets;
- seq64: mixed-step graphs of at most 64 sequences (the buckets before 4a029fe; larger steps eager);
- tok32: tokens 32 apart up to 1,024, then 128 apart;
- tok16: tokens 16 apart up to 512, 32 apart up to 1,024, then 128 apart;
- eager512: no graph above 512 tokens (`cuda_graph_max_tokens=512`).

    PYTHONPATH=src python lab/graph_bucket_ab.py [--model preset:qwen3-4b] [--rounds 2] \\
        [--variants shipped,tok32,tok16]

Prints one row per run: graphs, capture seconds, elapsed, output tok/s, and a checksum of the first tokens
(equal checksums: the variants generated the same tokens).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

VARIANTS = ("shipped", "seq64", "tok32", "tok16", "eager512")


def _token_steps(variant: str) -> tuple[int, ...]:
    if variant == "tok32":
        return (*range(32, 1024, 32), *range(1024, 2048, 128), 2048, 4096, 8192)
    return (*range(16, 512, 16), *range(512, 1024, 32), *range(1024, 2048, 128), 2048, 4096, 8192)


def run_one(model: str, variant: str, num: int) -> dict:
    import numpy as np

    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.datasets import random_requests
    from tokenmill.models.presets import resolve_model_path
    from tokenmill.runner import cuda_graphs

    keys = cuda_graphs.CudaGraphRunner._keys
    kwargs = {}
    if variant == "seq64":
        def patched(self):
            return [k for k in keys(self) if k[0] == "decode" or k[2] <= 64]
        cuda_graphs.CudaGraphRunner._keys = patched
    elif variant in ("tok32", "tok16"):
        def patched(self):
            shipped = keys(self)
            mixed = [k for k in shipped if k[0] == "mixed"]
            if not mixed:
                return shipped
            limit = max(k[1] for k in mixed)
            seqs = sorted({k[2] for k in mixed})
            tokens = sorted({t for t in _token_steps(variant) if t < limit} | {limit})
            return [k for k in shipped if k[0] == "decode"] + [("mixed", t, s) for t in tokens for s in seqs
                                                              if s <= t]
        cuda_graphs.CudaGraphRunner._keys = patched
    elif variant == "eager512":
        kwargs["cuda_graph_max_tokens"] = 512
    path = resolve_model_path(model)
    t0 = time.perf_counter()
    llm = LLM(path, max_num_seqs=512, **kwargs)
    ready = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size
    reqs = random_requests(num, (50, 300), (50, 300), vocab, seed=0)
    llm.generate([[1] * 16], SamplingParams(max_tokens=4, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    runner = llm.engine.runner
    return {"variant": variant, "elapsed_s": elapsed, "output_tok_s": tokens / elapsed, "ready_s": ready,
            "graphs": len(runner.graphs), "summary": getattr(getattr(runner, "graph_runner", None), "summary", ""),
            "checksum": int(np.sum([sum(o.outputs[0].token_ids[:4]) for o in outs]))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="preset:qwen3-4b")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=2048)
    p.add_argument("--variants", default="shipped,tok32,tok16")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        print(json.dumps(run_one(args.model, args.worker, args.num_prompts)))
        return
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    rows = []
    for r in range(args.rounds):
        for variant in variants:
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--num-prompts",
                                  str(args.num_prompts), "--worker", variant], capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["round"] = r
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| round | variant | graphs | ready s | elapsed s | output tok/s | checksum |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['round']} | {row['variant']} | {row['graphs']} | {row['ready_s']:.1f} | "
              f"{row['elapsed_s']:.2f} | {row['output_tok_s']:,.0f} | {row['checksum']} |")


if __name__ == "__main__":
    main()
