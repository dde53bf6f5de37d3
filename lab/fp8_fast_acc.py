"""Per-channel FP8 products with the tensor cores' own accumulation across K ("fast accumulation"), against
the shipped path, whose products add each K step's result in float32 (`fp8_rows`) or take `_scaled_mm`
with its default (promoted) accumulation.

On sm90 Triton waits for a wgmma whose result leaves the loop-carried accumulator at once (`acc += dot`),
so `fp8_rows` idles its tensor cores while each step's float32 add runs; `acc = tl.dot(w, x, acc)` keeps
the accumulator in the MMA and lets the next step's wgmma issue before the last completes, at the price
of the FP8 MMA's shorter accumulator (about 14 bits of mantissa on Hopper). Per-channel scales allow it
(one scale per row and weight row, applied at the end); block scales do not.

For qwen3-4b's four products at each row count: bf16, the shipped `fp8_linear`, `_fp8_rows_fast_kernel`
(this file: `fp8_rows` with the accumulation in the MMA) at `rows_tile`'s tile and at twice and half its
split, `quantize_rows` + `_scaled_mm(use_fast_accum=True)`; each one's largest error against the float32
product of the row-quantized input, over the largest output (bf16's own rounding of the output is
2^-9 = 2e-3 of it).

    python lab/fp8_fast_acc.py --out DIR [--rows 16,64,128,192,256,384,512]     DIR/fp8_fast_acc.md, .json
    python lab/fp8_fast_acc.py --check                                           the kernel on the CPU
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

if __name__ == "__main__" and "--check" in sys.argv and not torch.cuda.is_available():
    # the kernel tests' interpreter set-up (TRITON_INTERPRET and its patches), before Triton is imported
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "kernels"))
    __import__("conftest")
import triton
import triton.language as tl

from tokenmill.layers.kernels import split_k

SHAPES = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
COPIES = 8


@triton.jit(do_not_specialize=["M"])
def _fp8_rows_fast_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, x_stride,
                          w_stride, out_stride, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    # `fp8_gemm._fp8_rows_kernel` per channel, the K steps accumulated in the MMA
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(M, BLOCK_M)
    n_block = pid // m_blocks
    rows = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (pid % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_K)
    row_mask, m_mask = rows < N, m < M
    k_begin, k_end = split_k.k_range(K, BLOCK_K, SPLIT)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_stride
    x_cols = xq_ptr + m.to(tl.int64)[None, :] * x_stride
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + c
        w = tl.load(w_rows + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
        xq = tl.load(x_cols + kk[:, None], mask=(kk < K)[:, None] & m_mask[None, :], other=0.0)
        acc = tl.dot(w, xq, acc)
    acc, out_mask = split_k.gather(acc, row_mask[:, None] & m_mask[None, :], part_ptr, count_ptr, rows, m, N,
                                   m_blocks * BLOCK_M, SPLIT)
    acc *= tl.load(xs_ptr + m, mask=m_mask, other=0.0)[None, :] * \
        tl.load(s_ptr + rows, mask=row_mask, other=0.0)[:, None]
    tl.store(out_ptr + m.to(tl.int64)[None, :] * out_stride + rows[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=out_mask)


def fp8_rows_fast(x, weight, scale, tile, split=None):
    """x [M, K] @ (weight [N, K] FP8 * per-channel scale [N, 1])^T in x's dtype, the activations quantized
    per row; `tile` an `fp8_gemm.Fp8RowsTile`, `split` overriding its split."""
    from tokenmill.layers.kernels.fp8_gemm import quantize_rows
    M, K = x.shape
    N = weight.shape[0]
    split = split or tile.split_k
    xq, xs = quantize_rows(x)
    block_m = min(tile.block_m, max(16, triton.next_power_of_2(M)))
    m_blocks = triton.cdiv(M, block_m)
    blocks = triton.cdiv(N, tile.block_n) * m_blocks
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    part, count = split_k.scratch(x.device, split, N, m_blocks * block_m, blocks)
    _fp8_rows_fast_kernel[(blocks, split)](xq, xs, weight, scale, out, part, count, M, N, K, xq.stride(0),
                                           weight.stride(0), out.stride(0), SPLIT=split, BLOCK_N=tile.block_n,
                                           BLOCK_M=block_m, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages,
                                           num_warps=tile.num_warps)
    return out


def scaled_mm_fast(x, weight, scale):
    from tokenmill.layers.kernels.fp8_gemm import quantize_rows
    xq, xs = quantize_rows(x)
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype,
                            use_fast_accum=True)


def reference(x, q, s):
    """The float32 product of the row-quantized input with the dequantized weight."""
    from tokenmill.layers.kernels.fp8_gemm import quantize_rows_torch
    from tokenmill.quant import fp8
    xq, xs = quantize_rows_torch(x)
    return (xq.float() * xs) @ fp8.dequantize(q, s, (1, x.shape[1])).t()


def check_cpu():
    from tokenmill.layers.kernels.fp8_gemm import Fp8RowsTile
    from tokenmill.quant import fp8
    torch.manual_seed(0)
    for m, n, k, split in ((5, 96, 256, 1), (70, 130, 384, 3)):
        q, s = fp8.quantize(torch.randn(n, k) * 0.05)
        x = torch.randn(m, k)
        got = fp8_rows_fast(x, q, s, Fp8RowsTile(32, 64, 4, 2, split, 32))
        err = ((got - reference(x, q, s)).abs().max() / reference(x, q, s).abs().max()).item()
        print(m, n, k, split, f"err {err:.2e}")
        assert err < 1e-5


def bench(args):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "device"))
    from fp8_products import graph_us, write_report
    from tokenmill.layers.kernels.fp8_gemm import fp8_linear, rows_tile
    from tokenmill.quant import fp8
    rows = [int(r) for r in args.rows.split(",")]
    variants = ("bf16", "shipped", "fast, rows_tile", "fast, split x2", "fast, split / 2", "_scaled_mm fast")
    results, sums = [], {m: dict.fromkeys(variants, 0.0) for m in rows}
    errs = {m: dict.fromkeys(variants[1:], 0.0) for m in rows}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda").mul_(0.05) for _ in range(COPIES)]
        bf = [w.bfloat16() for w in ws]
        qs = [fp8.quantize(w) for w in ws]
        blk = (1, k)
        for m in rows:
            x = torch.randn(m, k, device="cuda").bfloat16()
            want = reference(x, *qs[0])
            tile = rows_tile(n, blk, x.device, m)
            fns = {"shipped": lambda q, s: fp8_linear(x, q, s, blk),
                   "fast, rows_tile": lambda q, s: fp8_rows_fast(x, q, s, tile),
                   "fast, split x2": lambda q, s: fp8_rows_fast(x, q, s, tile, 2 * tile.split_k),
                   "fast, split / 2": lambda q, s: fp8_rows_fast(x, q, s, tile, max(1, tile.split_k // 2)),
                   "_scaled_mm fast": lambda q, s: scaled_mm_fast(x, q, s)}
            row = {"product": name, "m": m, "bf16": graph_us([lambda w=w: F.linear(x, w) for w in bf])}
            for v, fn in fns.items():
                err = ((fn(*qs[0]).float() - want).abs().max() / want.abs().max()).item()
                row[v] = graph_us([lambda q=q, fn=fn: fn(*q) for q in qs])
                row[v + " err"] = err
                errs[m][v] = max(errs[m][v], err)
            for v in variants:
                sums[m][v] += row[v]
            results.append(row)
            print(row, flush=True)
        del ws, bf, qs
        torch.cuda.empty_cache()
    lines = ["us per layer (qwen3-4b's four products summed), and the largest error over the layer's products "
             "(max |out - W8A8 float32 reference| / max |reference|):", "",
             "| rows | " + " | ".join(variants) + " | shipped / best fast |", "|---" * (len(variants) + 2) + "|"]
    for m in rows:
        best = min(sums[m][v] for v in variants if v.startswith("fast") or v == "_scaled_mm fast")
        cells = [f"{sums[m]['bf16']:.1f}"] + [f"{sums[m][v]:.1f} ({errs[m][v]:.1e})" for v in variants[1:]]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {sums[m]['shipped'] / best:.2f}x |")
    write_report(args.out, "fp8_fast_acc", lines, results)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="16,64,128,192,256,384,512")
    p.add_argument("--check", action="store_true")
    a = p.parse_args()
    check_cpu() if a.check else bench(a)
