"""The attention kernels alone with a bf16 and an FP8 KV cache (qwen3-4b's heads: 32 q over 8 kv, head_dim
128, block size 16): a pure decode step's one-kernel attention (`decode_attention.fused_decode_attention`,
q/k norm and RoPE included) at 256 sequences, and a mixed step's (`paged_prefill_attention`: 255 decode
rows beside a 225-token prefill chunk). Run it with each tree's src on PYTHONPATH to compare kernels:

    PYTHONPATH=src python lab/kv_fp8_attention_bench.py --label new

Prints one row per case: microseconds per call (one layer), from triton.testing.do_bench, or with --graph
from do_bench_cudagraph (the calls replayed in a CUDA graph: kernel time without the host's launches).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from mixed_attention_bench import case as mixed_case, paged_kv  # noqa: E402  (it puts tests/kernels on sys.path)


def decode_case(batch: int, ctx_range: tuple[int, int], kv_fp8: bool, gen: torch.Generator):
    from tokenmill.layers.rotary import RotaryEmbedding
    hq, hkv, d, bs = 32, 8, 128, 16
    ctx = torch.randint(ctx_range[0], ctx_range[1] + 1, (batch,), generator=gen).tolist()
    k, v, table, kv_scale = paged_kv(ctx, kv_fp8, gen, hkv, d, bs)
    dev = k.device
    seq_lens = torch.tensor(ctx, dtype=torch.int32, device=dev)
    positions = (seq_lens - 1).to(torch.int64)
    # the new token's slot: its position's block in the sequence's table
    slots = (table.gather(1, (positions // bs)[:, None].to(torch.int64))[:, 0].to(torch.int64) * bs
             + positions % bs)
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, generator=gen).to(dev, torch.bfloat16)
    rope = RotaryEmbedding(d, 8192, 1e6).to(dev)
    w = torch.ones(d, dtype=torch.bfloat16, device=dev)
    return (qkv, positions, rope.cos_sin, w, w, 1e-6, k, v, slots, table, seq_lens, d ** -0.5, hq, hkv, d), \
        dict(kv_scale=kv_scale)


def time_us(fn, graph: bool) -> float:
    """Microseconds per call of fn: triton.testing.do_bench, or replayed in a CUDA graph with `graph`."""
    import triton.testing
    if graph:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=200)
    return 1e3 * triton.testing.do_bench(fn, warmup=20, rep=200)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--graph", action="store_true", help="time the calls replayed in a CUDA graph")
    a = p.parse_args()
    from tokenmill.layers.kernels import decode_attention as da
    from tokenmill.layers.kernels import paged_attention as pa
    for fp8 in (False, True):
        gen = torch.Generator().manual_seed(0)
        args, kw = decode_case(256, (100, 1000), fp8, gen)
        us = time_us(lambda: da.fused_decode_attention(*args, **kw), a.graph)
        print(f"| {a.label} | decode, 256 sequences, ctx 100-1000 | {'fp8' if fp8 else 'bf16'} KV | {us:.1f} us |",
              flush=True)
        gen = torch.Generator().manual_seed(0)
        args, kw = mixed_case(255, 225, (100, 700), fp8, gen)
        us = time_us(lambda: pa.paged_prefill_attention(*args, **kw), a.graph)
        print(f"| {a.label} | mixed, 255 decodes ctx 100-700 + prefill 225 | {'fp8' if fp8 else 'bf16'} KV | "
              f"{us:.1f} us |", flush=True)
        gen = torch.Generator().manual_seed(0)
        args, kw = mixed_case(16, 2048, (1000, 4000), fp8, gen)
        us = time_us(lambda: pa.paged_prefill_attention(*args, **kw), a.graph)
        print(f"| {a.label} | mixed, 16 decodes ctx 1000-4000 + prefill 2048 | {'fp8' if fp8 else 'bf16'} KV | "
              f"{us:.1f} us |", flush=True)


if __name__ == "__main__":
    main()
