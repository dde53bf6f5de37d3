"""FP8 per-channel products of 128-1,024 input rows through `torch._scaled_mm` with its operands swapped:
out^T = W x^T, the weight rows on the GEMM's M side and the input rows on its N side (cuBLASLt then
tiles the weight's 2,560-19,456 rows, not the few hundred input rows), against the shipped dispatch
(`fp8_linear`), `_scaled_mm` as shipped and bf16's `F.linear`. Each FP8 variant but the shipped one
takes the rows already quantized (`quantize_rows`, timed apart); "swap + T" adds the copy back to
[rows, N]. Errors are each variant's largest difference from the shipped `_scaled_mm` output over its
largest magnitude.

    python lab/fp8_swap_ab.py --out DIR [--rows 128,256,...] [--models qwen3-4b,nanbeige4.1-3b]
                                           DIR/fp8_swap_ab.md (also printed), DIR/fp8_swap_ab.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

SHAPES = {"qwen3-4b": {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
          "nanbeige4.1-3b": {"qkv": (3584, 2560), "o_proj": (2560, 2560), "gate_up": (20992, 2560),
                             "down": (2560, 10496)}}
COPIES = 8
VARIANTS = ("bf16", "shipped", "quantize_rows", "mm", "mm fast", "swap", "swap + T", "swap fast + T")


def main(args):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "device"))
    from fp8_products import graph_us, write_report
    from tokenmill.layers.kernels.fp8_gemm import fp8_linear, quantize_rows
    from tokenmill.quant import fp8
    rows = [int(r) for r in args.rows.split(",")]
    bf = torch.bfloat16
    lines = ["| model | product | M | " + " | ".join(VARIANTS) + " | best swap / mm | err swap | err swap fast |",
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
                fns = {
                    "bf16": [lambda w=w: F.linear(x, w) for w in bfs],
                    "shipped": [lambda q=q, s=s: fp8_linear(x, q, s, (1, k)) for q, s in qs],
                    "quantize_rows": [lambda: quantize_rows(x)] * COPIES,
                    "mm": [lambda q=q, s=s: torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1),
                                                             out_dtype=bf) for q, s in qs],
                    "mm fast": [lambda q=q, s=s: torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1),
                                                                  out_dtype=bf, use_fast_accum=True) for q, s in qs],
                    "swap": [lambda q=q, s=s: torch._scaled_mm(q, xq.t(), scale_a=s.view(-1, 1),
                                                               scale_b=xs.view(1, -1), out_dtype=bf) for q, s in qs],
                    "swap + T": [lambda q=q, s=s: torch._scaled_mm(q, xq.t(), scale_a=s.view(-1, 1),
                                                                   scale_b=xs.view(1, -1), out_dtype=bf).t().contiguous()
                                 for q, s in qs],
                    "swap fast + T": [lambda q=q, s=s: torch._scaled_mm(
                        q, xq.t(), scale_a=s.view(-1, 1), scale_b=xs.view(1, -1), out_dtype=bf,
                        use_fast_accum=True).t().contiguous() for q, s in qs],
                }
                ref = fns["mm"][0]().float()
                scale = ref.abs().max().item()
                err = {v: ((fns[v][0]().float() - ref).abs().max().item() / scale) for v in ("swap + T", "swap fast + T")}
                us = {v: graph_us(f) for v, f in fns.items()}
                best_swap = min(us["swap + T"], us["swap fast + T"])
                lines.append(f"| {model} | {name} | {m} | " + " | ".join(f"{us[v]:.2f}" for v in VARIANTS)
                             + f" | {best_swap / us['mm']:.2f} | {err['swap + T']:.1e} | {err['swap fast + T']:.1e} |")
                print(lines[-1], flush=True)
                for v in VARIANTS:
                    sums.setdefault((model, m), {}).setdefault(v, 0.0)
                    sums[(model, m)][v] += us[v]
                results.append({"model": model, "product": name, "m": m, "us": us, "err": err})
            del qs, bfs
            torch.cuda.empty_cache()
    lines += ["", "A layer's four products summed (us):", "",
              "| model | M | " + " | ".join(VARIANTS) + " | shipped / (quantize_rows + swap + T) |",
              "|" + "---|" * (len(VARIANTS) + 3)]
    for (model, m), s in sums.items():
        lines.append(f"| {model} | {m} | " + " | ".join(f"{s[v]:.1f}" for v in VARIANTS)
                     + f" | {s['shipped'] / (s['quantize_rows'] + s['swap + T']):.2f}x |")
    os.makedirs(args.out, exist_ok=True)
    write_report(args.out, "fp8_swap_ab", lines, results)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="64,128,192,256,320,384,512,768,1024")
    p.add_argument("--models", default="qwen3-4b,nanbeige4.1-3b")
    main(p.parse_args())
