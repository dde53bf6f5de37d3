"""Whether a Triton FP8 GEMM can beat cuBLASLt on the narrow products of a served step: torch inductor's
max-autotune over its `_scaled_mm` templates (persistent TMA on sm90 included) against the eager
`torch._scaled_mm` that `fp8_linear` runs above `ROWS_MAX` rows, per-channel weight scales and per-row
input scales, bf16 out.

    python lab/fp8_inductor_probe.py --out DIR [--rows 256,512] [--models qwen3-4b]
        DIR/fp8_inductor_probe.md (also printed); inductor's AUTOTUNE tables go to stderr

Microseconds per product inside a CUDA graph over COPIES weight copies (`fp8_products.graph_us`); each
compiled product is checked against the eager one first.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "device"))
from fp8_mid_rows import SHAPES  # noqa: E402  (lab/ is on sys.path when run from the repository root)

COPIES = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default="256,512")
    ap.add_argument("--models", default="qwen3-4b")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from fp8_products import graph_us
    import torch._inductor.config as ic
    ic.max_autotune_gemm_backends = "TRITON,ATEN"
    ic.triton.enable_persistent_tma_matmul = True
    ic.force_disable_caches = True

    def product(a, b, sa, sb):
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    def fast(a, b, sa, sb):
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)

    lines = ["| model | product | M | cuBLASLt us | fast accum us | inductor best us | cuBLASLt / inductor | "
             "FLOP floor us (1,979 TFLOP/s) | bytes floor us (4.3 TB/s) |", "|---|---|---|---|---|---|---|---|---|"]
    for model in args.models.split(","):
        for name, (n, k) in SHAPES[model].items():
            ws = [(torch.randn(n, k, device="cuda") * 0.02).to(torch.float8_e4m3fn) for _ in range(COPIES)]
            sb = torch.rand(1, n, device="cuda") * 1e-2 + 1e-3
            for m in [int(r) for r in args.rows.split(",")]:
                a = (torch.randn(m, k, device="cuda")).to(torch.float8_e4m3fn)
                sa = torch.rand(m, 1, device="cuda") * 1e-2 + 1e-3
                print(f"== {model} {name} M={m}", file=sys.stderr, flush=True)
                torch._dynamo.reset()
                compiled = torch.compile(product, mode="max-autotune-no-cudagraphs", dynamic=False)
                want = product(a, ws[0].t(), sa, sb).float()
                got = compiled(a, ws[0].t(), sa, sb).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                eager = graph_us([lambda w=w: product(a, w.t(), sa, sb) for w in ws])
                fa = graph_us([lambda w=w: fast(a, w.t(), sa, sb) for w in ws])
                ind = graph_us([lambda w=w: compiled(a, w.t(), sa, sb) for w in ws])
                flops = 2 * m * n * k / 1979e12 * 1e6
                byts = (n * k + m * k + 2 * m * n) / 4.3e12 * 1e6
                line = (f"| {model} | {name} | {m} | {eager:.2f} | {fa:.2f} | {ind:.2f} (err {err:.1e}) | "
                        f"{eager / ind:.2f}x | {flops:.2f} | {byts:.2f} |")
                print(line, flush=True)
                lines.append(line)
                with open(os.path.join(args.out, "fp8_inductor_probe.md"), "w") as f:   # kept as it grows
                    f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
