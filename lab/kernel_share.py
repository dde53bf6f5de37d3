"""Where the GPU's time goes in an offline run: CUDA kernel time by kernel name, from torch.profiler, over
the whole `generate` of a random workload (the default offline workload's shape, fewer requests).

    PYTHONPATH=src python lab/kernel_share.py preset:qwen3-4b [engine args as key=value, e.g.
        kv_cache_dtype=fp8 max_num_seqs=512] --label auto --out DIR [--num-prompts N] [--len-range 50,300]
        [--no-pdl]

With programmatic dependent launch (`layers/kernels/pdl.py`) a kernel starts while the one before it runs
and waits inside, so the profiler counts that wait in its time: per-kernel times overlap and their sum
overstates the GPU's busy time. --no-pdl launches every kernel plainly (the run is slower, but each
kernel's time is its own).

Writes DIR/kernels-LABEL.json (name -> [total ms, calls]) and prints the top kernels with their share.
"""
from __future__ import annotations

import argparse
import json
import os
import time


# kernel names by kind: cuBLAS / Triton products, attention, everything else
KINDS = [("products", ("nvjet", "gemm", "gemv", "cutlass", "fp8_rows", "w4_", "sm90_xmma", "_scaled_mm")),
         ("attention", ("attention", "_decode_rows", "_prefill", "_fused_decode", "paged"))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--label", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--len-range", default="100,1024", help="prompt and output lengths, uniform in lo,hi")
    p.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    p.add_argument("engine_args", nargs="*")
    args = p.parse_args()
    if args.no_pdl:
        from tokenmill.layers.kernels import pdl
        pdl.enabled = lambda device: False      # every launcher asks pdl.enabled at each launch
    import torch
    from torch.profiler import ProfilerActivity, profile
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.datasets import random_requests, special_token_ids
    from tokenmill.models.presets import resolve_model_path

    path = resolve_model_path(args.model)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    extra = {k: (int(v) if v.isdigit() else v) for k, v in (a.split("=", 1) for a in args.engine_args)}
    llm = LLM(path, **extra)
    lo, hi = (int(v) for v in args.len_range.split(","))
    requests = random_requests(args.num_prompts, (lo, hi), (lo, hi), hf["vocab_size"], special_token_ids(hf), 0)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    prompts = [r.prompt_token_ids for r in requests]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)          # compiles outside the profile
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    table = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
            ms = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 1e3
            if ms > 0:
                table[e.key] = [ms, e.count]
    total = sum(v[0] for v in table.values())
    with open(os.path.join(args.out, f"kernels-{args.label}.json"), "w") as f:
        json.dump(dict(wall_s=wall, kernel_ms=total, kernels=table), f, indent=1)
    print(f"## {args.label}: wall {wall:.2f} s (profiled), kernel time {total / 1e3:.2f} s")
    kinds = {}
    for name, (ms, _) in table.items():
        kind = next((k for k, words in KINDS if any(w in name for w in words)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    print(" | ".join(f"{k} {ms / 1e3:.2f} s ({100 * ms / total:.0f}%)" for k, ms in sorted(kinds.items(), key=lambda kv: -kv[1])))
    for name, (ms, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"| {name[:70]} | {ms:.0f} ms | {n} | {100 * ms / total:.1f}% |")


if __name__ == "__main__":
    main()
