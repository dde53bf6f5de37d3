"""The wide FP8 products (qkv, gate_up) at the few-row counts of decode graphs and mixed steps: the shipped
path (`fp8_linear` on rows already quantized, `fp8_rows` there) against cuBLASLt with scalar scales
(`torch._scaled_mm`, the unscaled product) into float32 and into bf16, and, for scale, the narrow products
(o_proj, down: shipped through cuBLASLt) beside them. What the shipped path would gain if the kernel after
qkv (the attention prologue) or gate_up (SiLU-and-mul) applied the scales as it loads the product, as the
RMSNorm does for o_proj and down (`quant/fp8.UnscaledRows`). "whole split" is `fp8_rows` where `rows_tile`
does not halve the K split above 64 rows (`HALF_SPLIT_ROWS` past every row count): the rule before it did.

    source scripts/device/env.sh; python lab/fp8_wide_tensorwise.py --out DIR [--rows 16,32,...]

us per product inside a CUDA graph over 8 weight copies; each path is checked against the float32 product
of the same FP8 operands first. DIR/fp8_wide_tensorwise.md (also printed) and .json.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "device"))

SHAPES = {"qwen3-4b": {"qkv": (6144, 2560), "gate_up": (19456, 2560), "o_proj": (2560, 4096),
                       "down": (2560, 9728)},
          "nanbeige4.1-3b": {"qkv": (3584, 2560), "gate_up": (20992, 2560), "o_proj": (2560, 2560),
                             "down": (2560, 10496)}}
COPIES = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,32,48,64,96,128,192")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from fp8_products import graph_us, write_report

    from tokenmill.layers.kernels import fp8_gemm
    from tokenmill.layers.kernels.fp8_gemm import fp8_linear, fp8_rows, rows_tile, tensorwise_fits
    from tokenmill.layers.kernels.fp8_quantize import quantize_rows
    from tokenmill.quant import fp8
    from tokenmill.quant.fp8 import Fp8Rows

    one = torch.ones((), device="cuda")
    results = []
    lines = ["| model | product | rows | shipped us | whole split us | tw f32 us | tw bf16 us | shipped / tw f32 | "
             "shipped / tw bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    for model, shapes in SHAPES.items():
        for name, (n, k) in shapes.items():
            qs = [fp8.quantize(torch.randn(n, k, device="cuda").mul_(0.05)) for _ in range(COPIES)]
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda").bfloat16()
                xq, xs = quantize_rows(x)
                rows = Fp8Rows(xq, xs, k, torch.bfloat16)
                want = (xq.float() * xs) @ fp8.dequantize(*qs[0], (1, k)).t()

                def shipped(q, s):
                    return fp8_linear(rows, q, s, (1, k))

                def tw(q, s, dtype):
                    return torch._scaled_mm(xq, q.t(), scale_a=one, scale_b=one, out_dtype=dtype, use_fast_accum=True)
                for label, got in (("shipped", shipped(*qs[0]).float()),
                                   ("tw", tw(*qs[0], torch.float32) * xs * qs[0][1].view(1, -1))):
                    err = ((got - want).abs().max() / want.abs().mean()).item()
                    if err > 0.1:
                        raise SystemExit(f"{model} {name} rows {m} {label}: relative error {err:.3f}")
                whole = None
                if m > 64 and not tensorwise_fits((n, k), (1, k), m):
                    shipped_half = fp8_gemm.HALF_SPLIT_ROWS
                    fp8_gemm.HALF_SPLIT_ROWS = 1 << 30
                    tile = rows_tile(n, (1, k), x.device, m)
                    fp8_gemm.HALF_SPLIT_ROWS = shipped_half
                    whole = graph_us([lambda q=q: fp8_rows(rows, *q, (1, k), None, tile) for q in qs])
                us = {"shipped": graph_us([lambda q=q: shipped(*q) for q in qs]), "whole_split": whole,
                      "tw_f32": graph_us([lambda q=q: tw(*q, torch.float32) for q in qs]),
                      "tw_bf16": graph_us([lambda q=q: tw(*q, torch.bfloat16) for q in qs])}
                results.append({"model": model, "product": name, "rows": m, **us})
                lines.append(f"| {model} | {name} | {m} | {us['shipped']:.2f} | "
                             f"{'-' if whole is None else f'{whole:.2f}'} | {us['tw_f32']:.2f} | "
                             f"{us['tw_bf16']:.2f} | {us['shipped'] / us['tw_f32']:.2f}x | "
                             f"{us['shipped'] / us['tw_bf16']:.2f}x |")
                print(lines[-1], flush=True)
            del qs
            torch.cuda.empty_cache()
    write_report(args.out, "fp8_wide_tensorwise", lines, results)


if __name__ == "__main__":
    main()
