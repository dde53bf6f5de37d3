"""The attention of a mixed step alone: decode rows beside a prefill chunk, through the prefill kernel's
tile map as the mixed-step CUDA graphs run it (qwen3-4b's heads: 32 q over 8 kv, head_dim 128, bf16,
block size 16). Run it with each tree's src on PYTHONPATH to compare kernels:

    PYTHONPATH=src python lab/mixed_attention_bench.py --label new

Prints one row per case: microseconds per call (one layer), from triton.testing.do_bench.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from kernel_testing import _paged_cache  # noqa: E402  (the kernel tests' scattered paged cache)


def paged_kv(seq_lens: list[int], kv_fp8: bool, gen: torch.Generator, hkv: int = 8, d: int = 128, bs: int = 16):
    """A scattered paged cache for seq_lens (bf16, or E4M3 with unit scales): (k, v, table, kv_scale)."""
    k, v, table = _paged_cache(seq_lens, bs, hkv, d, torch.bfloat16, gen, spare_blocks=1)
    if not kv_fp8:
        return k, v, table, None
    return k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), table, torch.ones(2, device=k.device)


def case(decodes: int, prefill: int, ctx_range: tuple[int, int], kv_fp8: bool, gen: torch.Generator):
    from tokenmill.layers.attention_metadata import PREFILL_BLOCK_M, prefill_tiles
    hq, d = 32, 128
    ctx = torch.randint(ctx_range[0], ctx_range[1] + 1, (decodes,), generator=gen).tolist()
    seq_lens = ctx + ([prefill] if prefill else [])
    q_lens = [1] * decodes + ([prefill] if prefill else [])
    k, v, table, kv_scale = paged_kv(seq_lens, kv_fp8, gen)
    dev = k.device
    t = sum(q_lens)
    q = torch.randn(t, hq, d, generator=gen).to(dev, torch.bfloat16)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    tiles = torch.from_numpy(prefill_tiles(q_lens, t // PREFILL_BLOCK_M + len(q_lens))).to(dev)
    args = (q, k, v, table, torch.tensor(seq_lens, dtype=torch.int32, device=dev), qsl, max(q_lens),
            d ** -0.5)
    return args, dict(tiles=tiles, kv_scale=kv_scale)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    a = p.parse_args()
    import triton.testing
    from tokenmill.layers.kernels import paged_attention as pa
    gen = torch.Generator().manual_seed(0)
    cases = [(63, 225, (100, 700), False), (255, 225, (100, 700), False), (255, 0, (100, 700), False),
             (255, 225, (100, 700), True), (16, 2048, (1000, 4000), False)]
    for decodes, prefill, ctx_range, fp8 in cases:
        args, kw = case(decodes, prefill, ctx_range, fp8, gen)
        us = 1e3 * triton.testing.do_bench(lambda: pa.paged_prefill_attention(*args, **kw), warmup=20, rep=200)
        print(f"| {a.label} | {decodes} decodes, ctx {ctx_range[0]}-{ctx_range[1]} | prefill {prefill} | "
              f"{'fp8' if fp8 else 'bf16'} KV | {us:.1f} us |", flush=True)


if __name__ == "__main__":
    main()
