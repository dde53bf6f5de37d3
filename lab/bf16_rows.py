"""A 16-bit product of 16-256 input rows with the weight rows on the tensor cores' wide side (the form of
`fp8_gemm.fp8_rows`, for bf16 weights and inputs): tl.dot(w [BLOCK_N, BLOCK_K], x^T [BLOCK_K, BLOCK_M]), the
K steps split over enough programs to fill the SMs (`split_k`, deterministic), against `F.linear` (cuBLAS).

Serving at concurrency 64 runs steps of about 56 decode rows and 120 tokens; there cuBLAS reads the weights
at 2.2-3.2 TB/s (qwen3-4b at 64 rows: qkv 11.0 us, o_proj 9.6, gate_up 31.1, down 18.9, docs/BENCHMARKS.md),
and the products are about 60% of the step. The question: does a few-row tile that splits K reach more?

    TRITON_INTERPRET=1 python lab/bf16_rows.py check          # CPU: the kernel against F.linear, small shapes
    python lab/bf16_rows.py bench [--rows 16,32,64,128,256]   # GPU: us per product, each tile and cuBLAS

The bench times each product inside one CUDA graph over COPIES weight copies (so that the weights come from
HBM, not L2), for qwen3-4b's and nanbeige4.1-3b's products, and prints one row per (product, M): cuBLAS,
the best tile and its us, and their ratio, the best tile's output checked against F.linear first.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.layers.kernels import split_k

SHAPES = {"qwen3-4b": {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
          "nanbeige4.1-3b": {"qkv": (3584, 2560), "o_proj": (2560, 2560), "gate_up": (20992, 2560),
                             "down": (2560, 10496)}}
# (block_n, block_k, num_warps, num_stages); the split is chosen per product so that the programs fill the
# SMs `waves` times
TILES = ((64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 6), (128, 64, 8, 5))
WAVES = (1, 2)
COPIES = 8


@triton.jit
def _rows_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, x_stride, w_stride, out_stride,
                 SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    # out[m, n] = sum over k of x[m, k] * w[n, k]; program (p, s): weight rows p * BLOCK_N ..., split s of the
    # K steps
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_K)
    row_mask, m_mask = rows < N, m < M
    k_begin, k_end = split_k.k_range(K, BLOCK_K, SPLIT)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_stride
    x_cols = x_ptr + m.to(tl.int64)[None, :] * x_stride
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + c
        w = tl.load(w_rows + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
        x = tl.load(x_cols + kk[:, None], mask=(kk < K)[:, None] & m_mask[None, :], other=0.0)
        acc = tl.dot(w, x, acc)
    acc, out_mask = split_k.gather(acc, row_mask[:, None] & m_mask[None, :], part_ptr, count_ptr, rows, m, N,
                                   BLOCK_M, SPLIT)
    tl.store(out_ptr + m.to(tl.int64)[None, :] * out_stride + rows[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=out_mask)


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def rows_linear(x: torch.Tensor, w: torch.Tensor, tile: tuple[int, int, int, int], waves: int = 1) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T in x's dtype, M <= 256."""
    M, K = x.shape
    N = w.shape[0]
    block_n, block_k, warps, stages = tile
    block_m = max(16, triton.next_power_of_2(M))
    blocks = triton.cdiv(N, block_n)
    split = max(1, min(triton.cdiv(waves * num_sms(x.device), blocks), triton.cdiv(K, block_k)))
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    part, count = split_k.scratch(x.device, split, N, block_m, blocks)
    _rows_kernel[(blocks, split)](x, w, out, part, count, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                  SPLIT=split, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k,
                                  NUM_STAGES=stages, num_warps=warps)
    return out


def check() -> None:
    if not torch.cuda.is_available():      # the kernel tests' patches of Triton's interpreter
        import runpy
        runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "tests", "kernels", "conftest.py"))
    torch.manual_seed(0)
    for m, n, k in ((3, 70, 96), (17, 128, 256), (40, 200, 130)):
        x = torch.randn(m, k)
        w = torch.randn(n, k)
        want = F.linear(x, w)
        for tile in ((64, 32, 4, 2), (16, 64, 4, 1)):
            for waves in (1, 4):
                got = rows_linear(x, w, tile, waves)
                err = (got - want).abs().max().item()
                assert err < 1e-3 * want.abs().max().item(), (m, n, k, tile, waves, err)
    print("rows_linear equals F.linear on the CPU (float32, 3 shapes, 2 tiles, 1 and several splits)")


def bench(rows: list[int]) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "device"))
    from fp8_products import graph_us
    dev = torch.device("cuda")
    print("| model | product | M | cuBLAS us | best tile (n, k, warps, stages, waves) | its us | cuBLAS / tile | "
          "tile TB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for model, shapes in SHAPES.items():
        for name, (n, k) in shapes.items():
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16).mul_(0.05) for _ in range(COPIES)]
            for m in rows:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                base = graph_us([lambda w=w: F.linear(x, w) for w in ws])
                want = F.linear(x, ws[0]).float()
                best = None
                for tile in TILES:
                    for waves in WAVES:
                        got = rows_linear(x, ws[0], tile, waves).float()
                        if (got - want).abs().max().item() > 2e-2 * want.abs().max().item():
                            print(f"| {model} | {name} | {m} | tile {tile} x{waves} differs from F.linear |")
                            continue
                        us = graph_us([lambda w=w: rows_linear(x, w, tile, waves) for w in ws])
                        if best is None or us < best[0]:
                            best = (us, tile, waves)
                us, tile, waves = best
                print(f"| {model} | {name} | {m} | {base:.2f} | {(*tile, waves)} | {us:.2f} | {base / us:.2f} | "
                      f"{n * k * 2 / us / 1e6:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["check", "bench"])
    p.add_argument("--rows", default="16,32,64,128,192,256")
    a = p.parse_args()
    if a.mode == "check":
        check()
    else:
        bench([int(r) for r in a.rows.split(",")])


if __name__ == "__main__":
    main()
