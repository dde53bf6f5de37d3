"""The FP8 row quantization inside RMSNorm and SiLU-and-mul against the plain kernel followed by
`quantize_rows`, at qwen3-4b's widths (hidden 2,560, intermediate 9,728), us per call inside a CUDA graph
of 20 calls (PDL off), and the whole-row SiLU-and-mul at 8, 16 (shipped) and 32 warps.

    python lab/fused_quant_bench.py            # on the GPU; a markdown table on stdout
    TRITON_INTERPRET=1 python lab/fused_quant_bench.py --check   # each variant once on the CPU, small rows
"""
from __future__ import annotations

import argparse

import torch
import triton

from tokenmill.layers.kernels import fused_ops
from tokenmill.layers.kernels.fp8_gemm import quantize_rows
from tokenmill.quant.fp8 import FP8

HIDDEN, INTER = 2560, 9728


def silu_fp8_warps(x: torch.Tensor, warps: int):
    """The whole-row FP8 SiLU-and-mul at `warps` warps (the shipped launch but for the warp count)."""
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(inter)
    fused_ops._silu_and_mul_kernel[(x.shape[0], 1)](x, out, scale, x.stride(0), scale.stride(0), I=inter, BLOCK=block,
                                                    FP8_GROUP=block, PDL=False, num_warps=warps)
    return out, scale


def variants(rows: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, HIDDEN, device=device, generator=g).to(dtype)
    res = torch.randn(rows, HIDDEN, device=device, generator=g).to(dtype)
    w = torch.randn(HIDDEN, device=device, generator=g).to(dtype)
    gu = torch.randn(rows, 2 * INTER, device=device, generator=g).to(dtype)
    return {
        "rms_norm + quantize_rows": lambda: quantize_rows(fused_ops.rms_norm(x, w, 1e-6, res)[0]),
        "rms_norm, FP8 out": lambda: fused_ops.rms_norm(x, w, 1e-6, res, fp8_group=HIDDEN),
        "silu_and_mul + quantize_rows": lambda: quantize_rows(fused_ops.silu_and_mul(gu)),
        "silu_and_mul, FP8 out (16 warps, shipped)": lambda: fused_ops.silu_and_mul(gu, fp8_group=INTER),
        "silu_and_mul, FP8 out, 8 warps": lambda: silu_fp8_warps(gu, 8),
        "silu_and_mul, FP8 out, 32 warps": lambda: silu_fp8_warps(gu, 32),
        "silu_and_mul alone": lambda: fused_ops.silu_and_mul(gu),
        "rms_norm alone": lambda: fused_ops.rms_norm(x, w, 1e-6, res),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="run each variant once (CPU, interpreter)")
    p.add_argument("--rows", default="16,64,154,512,2048")
    args = p.parse_args()
    if args.check:
        for name, fn in variants(3, "cpu", torch.float32).items():
            fn()
            print("ran", name)
        return
    rows = [int(r) for r in args.rows.split(",")]
    table = {}
    for m in rows:
        for name, fn in variants(m, "cuda", torch.bfloat16).items():
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    fn()
            table.setdefault(name, {})[m] = triton.testing.do_bench(graph.replay, warmup=25, rep=200) * 1000 / 20
    print(f"| variant | {' | '.join(f'{m} rows' for m in rows)} |")
    print(f"|---|{'---|' * len(rows)}")
    for name, times in table.items():
        print(f"| {name} | {' | '.join(f'{times[m]:.2f}' for m in rows)} |")


if __name__ == "__main__":
    main()
