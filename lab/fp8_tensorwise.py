"""FP8 per-channel products of 64-1,024 rows through `torch._scaled_mm` with tensor-wise (scalar) scales
of 1 and the per-row and per-channel scales applied afterwards, against the shipped rowwise call. With
rowwise scales `_scaled_mm` runs PyTorch's own rowwise kernel; with scalar scales it runs cuBLASLt, whose
heuristics may split K on the narrow products (down_proj stays at ~26 us from 64 to 512 rows rowwise).
Variants, all on rows already quantized (`quantize_rows`):
- rowwise: as shipped;
- tw bf16: scalar scales, bf16 out (no per-channel scales: the GEMM's own time);
- tw f32: scalar scales, float32 out;
- tw f32 + epilogue: then `_scale_kernel` (out * row scale * channel scale -> bf16), the shipped result;
- the same with use_fast_accum.
Errors: the largest difference from the rowwise output over its largest magnitude.

    python lab/fp8_tensorwise.py --out DIR [--rows ...] [--models ...]     DIR/fp8_tensorwise.{md,json}
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

SHAPES = {"qwen3-4b": {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
          "nanbeige4.1-3b": {"qkv": (3584, 2560), "o_proj": (2560, 2560), "gate_up": (20992, 2560),
                             "down": (2560, 10496)}}
COPIES = 8
VARIANTS = ("bf16", "rowwise", "tw bf16", "tw f32", "tw f32 + epi", "tw fast f32 + epi")


@triton.jit
def _scale_kernel(x_ptr, rs_ptr, cs_ptr, out_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0)
    rs = tl.load(rs_ptr + rm, mask=rm < M, other=0.0)
    cs = tl.load(cs_ptr + rn, mask=rn < N, other=0.0)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], (x * rs[:, None] * cs[None, :]).to(tl.bfloat16), mask=mask)


def scaled(x32, rs, cs):
    M, N = x32.shape
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x32.device)
    _scale_kernel[(triton.cdiv(M, 32), triton.cdiv(N, 128))](x32, rs, cs, out, M, N, BLOCK_M=32, BLOCK_N=128,
                                                             num_warps=4)
    return out


def main(args):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "device"))
    from fp8_products import graph_us, write_report
    from tokenmill.layers.kernels.fp8_gemm import quantize_rows
    from tokenmill.quant import fp8
    rows = [int(r) for r in args.rows.split(",")]
    bf, f32 = torch.bfloat16, torch.float32
    one = torch.ones((), device="cuda")
    lines = ["| model | product | M | " + " | ".join(VARIANTS) + " | rowwise / tw f32 + epi | err tw | err tw fast |",
             "|" + "---|" * (len(VARIANTS) + 6)]
    sums: dict = {}
    results = []
    for model in args.models.split(","):
        for name, (n, k) in SHAPES[model].items():
            ws = [torch.randn(n, k, device="cuda").mul_(0.05) for _ in range(COPIES)]
            qs = [fp8.quantize(w) for w in ws]
            bfs = [w.to(bf) for w in ws]
            del ws
            for m in rows:
                x = torch.randn(m, k, device="cuda").to(bf)
                xq, xs = quantize_rows(x)
                xs1 = xs.view(-1)
                fns = {
                    "bf16": [lambda w=w: torch.nn.functional.linear(x, w) for w in bfs],
                    "rowwise": [lambda q=q, s=s: torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1),
                                                                  out_dtype=bf) for q, s in qs],
                    "tw bf16": [lambda q=q: torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one, out_dtype=bf)
                                for q, _ in qs],
                    "tw f32": [lambda q=q: torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one, out_dtype=f32)
                               for q, _ in qs],
                    "tw f32 + epi": [lambda q=q, s=s: scaled(torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one,
                                                                              out_dtype=f32), xs1, s.view(-1))
                                     for q, s in qs],
                    "tw fast f32 + epi": [lambda q=q, s=s: scaled(torch._scaled_mm(
                        xq, q.t(), scale_a=one, scale_b=one, out_dtype=f32, use_fast_accum=True), xs1, s.view(-1))
                        for q, s in qs],
                }
                ref = fns["rowwise"][0]().float()
                mag = ref.abs().max().item()
                err = {v: (fns[v][0]().float() - ref).abs().max().item() / mag
                       for v in ("tw f32 + epi", "tw fast f32 + epi")}
                us = {v: graph_us(f) for v, f in fns.items()}
                lines.append(f"| {model} | {name} | {m} | " + " | ".join(f"{us[v]:.2f}" for v in VARIANTS)
                             + f" | {us['rowwise'] / us['tw f32 + epi']:.2f}x | {err['tw f32 + epi']:.1e} | "
                               f"{err['tw fast f32 + epi']:.1e} |")
                print(lines[-1], flush=True)
                for v in VARIANTS:
                    sums.setdefault((model, m), {}).setdefault(v, 0.0)
                    sums[(model, m)][v] += us[v]
                results.append({"model": model, "product": name, "m": m, "us": us, "err": err})
            del qs, bfs
            torch.cuda.empty_cache()
    lines += ["", "A layer's four products summed (us):", "",
              "| model | M | " + " | ".join(VARIANTS) + " | rowwise / tw f32 + epi | rowwise / best per product |",
              "|" + "---|" * (len(VARIANTS) + 4)]
    best: dict = {}
    for r in results:
        b = min(r["us"]["rowwise"], r["us"]["tw f32 + epi"])
        best[(r["model"], r["m"])] = best.get((r["model"], r["m"]), 0.0) + b
    for (model, m), s in sums.items():
        lines.append(f"| {model} | {m} | " + " | ".join(f"{s[v]:.1f}" for v in VARIANTS)
                     + f" | {s['rowwise'] / s['tw f32 + epi']:.2f}x | {s['rowwise'] / best[(model, m)]:.2f}x |")
    os.makedirs(args.out, exist_ok=True)
    write_report(args.out, "fp8_tensorwise", lines, results)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="64,128,192,256,384,512,768,1024")
    p.add_argument("--models", default="qwen3-4b,nanbeige4.1-3b")
    main(p.parse_args())
