"""Split counts of the decode attention kernels at the batch sizes that serving runs (qwen3-4b's heads: 32 q
over 8 kv, head_dim 128, block size 16): the one-kernel decode step (`fused_decode_attention`) and a mixed
step's decode rows beside a 64-token prefill chunk (`paged_prefill_attention`), each at its shipped split
rule and at fixed split counts, with a bf16 and an FP8 cache. Each call is timed inside a CUDA graph of 20
calls (the host's launch cost left out, as in the engine's graphs). Run once per source tree:

    PYTHONPATH=src python lab/attention_split_sweep.py --label new

Prints one row per (kernel, batch, contexts, cache, splits): us per call, the K/V GB/s it reads, and the
largest difference from the first variant's output.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kv_fp8_attention_bench import decode_case  # noqa: E402
from mixed_attention_bench import case as mixed_case  # noqa: E402


def graph_us(fn, calls: int = 20, turns: int = 10) -> float:
    """us per call of fn, replayed inside a CUDA graph of `calls` calls (on the CPU: one call, 0 us)."""
    if not torch.cuda.is_available():
        fn()
        return 0.0
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(turns):
        g.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (calls * turns)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--batches", default="16,32,64,128,256")
    p.add_argument("--splits", default="1,2,4,8")
    p.add_argument("--contexts", default="100-700,1000-2000")
    a = p.parse_args()
    from tokenmill.layers.kernels import decode_attention as da
    from tokenmill.layers.kernels import paged_attention as pa
    splits = [None] + [int(s) for s in a.splits.split(",")]
    contexts = [tuple(int(x) for x in c.split("-")) for c in a.contexts.split(",")]
    print("| tree | kernel | batch | contexts | cache | splits | us | K/V GB/s | max diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fp8 in (False, True):
        cache = "fp8" if fp8 else "bf16"
        for lo, hi in contexts:
            for batch in (int(b) for b in a.batches.split(",")):
                gen = torch.Generator().manual_seed(batch)
                args, kw = decode_case(batch, (lo, hi), fp8, gen)
                kv = sum(args[10].tolist()) * 8 * 128 * 2 * (1 if fp8 else 2)
                k_cache, v_cache = args[6].clone(), args[7].clone()

                def fused(n):
                    return da.fused_decode_attention(*args, **kw, num_splits=n)
                gen = torch.Generator().manual_seed(batch)
                margs, mkw = mixed_case(batch - 1, 64, (lo, hi), fp8, gen)
                mkv = sum(margs[4].tolist()[:-1]) * 8 * 128 * 2 * (1 if fp8 else 2)

                def rows(n):
                    return pa.paged_prefill_attention(*margs, **mkw, num_splits=n)
                for kernel, call, nbytes in (("decode", fused, kv), ("mixed rows", rows, mkv)):
                    ref = None
                    for n in splits:
                        args[6].copy_(k_cache)
                        args[7].copy_(v_cache)
                        out = call(n).float()
                        ref = out if ref is None else ref
                        us = graph_us(lambda: call(n))
                        label = "rule" if n is None else str(n)
                        rate = nbytes / max(us, 1e-9) / 1e3
                        print(f"| {a.label} | {kernel} | {batch} | {lo}-{hi} | {cache} | {label} | {us:.1f} | "
                              f"{rate:.0f} | {(out - ref).abs().max().item():.1e} |", flush=True)


if __name__ == "__main__":
    main()
