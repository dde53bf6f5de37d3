"""Decode attention's launch configurations with a bf16 and an FP8 KV cache, one layer of qwen3-4b's heads
(32 q over 8 kv, head_dim 128, block size 16): the one-kernel decode step (`fused_decode_attention`), by
default at 256 sequences of two context ranges (`--decode-cases`), and a mixed step's decode rows beside a prefill chunk
(`paged_prefill_attention`, whose decode rows take the same `DecodeAttentionConfig`). Each configuration is
`shipped` (each cache's shipped launch) or (block_n, num_warps, num_stages[, the FP8 variants' register cap, 0:
none[, min_split_len]]). Run once per source tree (PYTHONPATH) to compare kernels:

    PYTHONPATH=src python lab/attention_config_sweep.py --label new --configs shipped,64x4x2,32x2x3x128

Prints one row per (case, cache, configuration): microseconds per call (triton.testing.do_bench; with
--graph do_bench_cudagraph, the calls replayed in a CUDA graph, which the mixed steps need: their plain
figures moved by up to 27% between calls on one tree), the GB/s of K/V it reads, and the largest
difference from the shipped configuration's output.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kv_fp8_attention_bench import decode_case, time_us  # noqa: E402
from mixed_attention_bench import case as mixed_case  # noqa: E402


def kv_bytes(seq_lens, fp8: bool) -> int:
    return sum(seq_lens) * 8 * 128 * 2 * (1 if fp8 else 2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--configs", default="shipped")
    p.add_argument("--prefill-maxnreg", default="", help="comma-separated register caps for the prefill kernel's "
                   "FP8 variant (0: none), timed on two mixed steps after the shipped configuration")
    p.add_argument("--prefill-stages", default="", help="comma-separated software-pipelining stage counts for "
                   "the prefill kernel, timed like --prefill-maxnreg")
    p.add_argument("--caches", default="bf16,fp8", help="which KV caches to time (bf16, fp8)")
    p.add_argument("--decode-cases", default="256:100-1000,256:1000-2000",
                   help="one-kernel decode cases, comma-separated sequences:shortest-longest context (64:6000-8000: "
                        "the long workload's decodes, two splits a sequence with an FP8 cache); a third field "
                        "fixes the split count (64:100-1000:2) where decode_num_splits would choose")
    p.add_argument("--graph", action="store_true", help="time the calls replayed in a CUDA graph")
    a = p.parse_args()
    import dataclasses

    from tokenmill.layers.kernel_config import SHIPPED_DECODE, SHIPPED_FP8_DECODE, PrefillAttentionConfig
    from tokenmill.layers.kernels import decode_attention as da
    from tokenmill.layers.kernels import paged_attention as pa
    configs = []   # (label, {cache: DecodeAttentionConfig})
    for c in a.configs.split(","):
        if c == "shipped":
            configs.append((c, {"bf16": SHIPPED_DECODE, "fp8": SHIPPED_FP8_DECODE}))
            continue
        bn, nw, st, *more = (int(x) for x in c.split("x"))
        # a fourth number caps the registers of both FP8 decode kernels (0: uncapped; without it each
        # takes its shipped cap), a fifth is min_split_len (without it block_n); bf16 runs uncapped
        caps = dict(maxnreg=more[0] or None, rows_maxnreg=more[0] or None) if more else {}
        launch = dict(block_n=bn, num_warps=nw, num_stages=st, min_split_len=more[1] if len(more) > 1 else bn)
        configs.append((c, {"bf16": dataclasses.replace(SHIPPED_DECODE, **launch, one_split=None, filled=None),
                            "fp8": dataclasses.replace(SHIPPED_FP8_DECODE, **launch, **caps, one_split=None,
                                                         filled=None)}))
    def sweep(row: str, variants, call, kv=None):
        # one table row per variant: us per call, K/V GB/s (kv: its bytes), largest difference from the first
        ref = None
        for label, cfg in variants:
            try:
                out = call(cfg).float()
            except Exception as e:  # a configuration that does not compile (shared memory, shapes)
                print(f"| {a.label} | {row} | {label} | failed: {type(e).__name__}: {str(e)[:80]} | - | - |", flush=True)
                continue
            ref = out if ref is None else ref
            us = time_us(lambda: call(cfg), a.graph)
            rate = f"{kv / us / 1e3:.0f} GB/s" if kv else "-"
            print(f"| {a.label} | {row} | {label} | {us:.1f} us | {rate} | {(out - ref).abs().max().item():.2e} |",
                  flush=True)

    prefill_variants = [("maxnreg shipped", PrefillAttentionConfig())] + [
        (f"maxnreg {r}", PrefillAttentionConfig(fp8_maxnreg=int(r) or None)) for r in a.prefill_maxnreg.split(",") if r] + [
        (f"stages {n}", PrefillAttentionConfig(num_stages=int(n))) for n in a.prefill_stages.split(",") if n]
    for fp8 in (False, True):
        cache = "fp8" if fp8 else "bf16"
        if cache not in a.caches.split(","):
            continue
        cache_configs = [(label, by_cache[cache]) for label, by_cache in configs]
        for case in a.decode_cases.split(","):
            seqs, lens, *splits = case.split(":")
            ctx = tuple(int(x) for x in lens.split("-"))
            name = f"decode {seqs}, ctx {lens}" + (f", {splits[0]} splits" if splits else "")
            args, kw = decode_case(int(seqs), ctx, fp8, torch.Generator().manual_seed(0))
            if splits:
                kw["num_splits"] = int(splits[0])
            sweep(f"{name} | {cache}", cache_configs, lambda cfg: da.fused_decode_attention(*args, **kw, config=cfg),
                  kv_bytes(args[10].tolist(), fp8))
        args, kw = mixed_case(255, 225, (100, 700), fp8, torch.Generator().manual_seed(0))
        sweep(f"mixed, 255 decodes ctx 100-700 + prefill 225 | {cache}", cache_configs,
              lambda cfg: pa.paged_prefill_attention(*args, **kw, decode_config=cfg))
        for name, decodes, prefill, ctx in (("16 decodes ctx 1000-4000 + prefill 2048", 16, 2048, (1000, 4000)),
                                            ("255 decodes ctx 100-700 + prefill 225", 255, 225, (100, 700))):
            args, kw = mixed_case(decodes, prefill, ctx, fp8, torch.Generator().manual_seed(0))
            sweep(f"prefill kernel: {name} | {cache}", prefill_variants,
                  lambda cfg: pa.paged_prefill_attention(*args, **kw, config=cfg))

if __name__ == "__main__":
    main()
