"""cuBLASLt's FP8 fast accumulation (`torch._scaled_mm(..., use_fast_accum=True)`: the tensor cores' partial
sums are not promoted to float32 every few K steps) on the two `_scaled_mm` calls of `fp8_gemm`: its time
and the error it adds, per product and row count.

    python lab/fp8_fast_accum.py --out DIR [--rows 64,128,256,384,512,1024,2048] [--models qwen3-4b,nanbeige4.1-3b]
        DIR/fp8_fast_accum.md (also printed), DIR/fp8_fast_accum.json

Each product runs where `fp8_gemm.fp8_linear` would send it: `tensorwise` (scalar scales, float32 out, as
`fp8_linear_tensorwise`) for o_proj and down at up to `TENSORWISE_MAX_ROWS`, `rowwise` (row and channel scales,
bf16 out, as `fp8_linear_many`) above `ROWS_MAX` otherwise. Microseconds a product inside a CUDA graph
over COPIES weight copies. Errors: the output against the float64 product of the same FP8 operands and
scales (the accumulation's own error), as the root mean square over the reference's, beside the FP8
product's error against the bf16 product of the unquantized operands (what quantization already costs).
The inputs have a few outlier channels, as a served model's activations do.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "device"))
from fp8_mid_rows import SHAPES  # noqa: E402  (lab/ is on sys.path when run from the repository root)

COPIES = 8


def rms_rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default="64,128,256,384,512,1024,2048")
    ap.add_argument("--models", default="qwen3-4b,nanbeige4.1-3b")
    args = ap.parse_args()
    from fp8_products import graph_us
    from tokenmill.layers.kernels.fp8_gemm import ROWS_MAX, TENSORWISE_MAX_ROWS
    from tokenmill.layers.kernels.fp8_quantize import quantize_rows
    from tokenmill.quant.fp8 import FP8, FP8_MAX
    torch.manual_seed(0)
    dev = torch.device("cuda")
    one = torch.ones((), device=dev)

    lines = ["| model | product | M | path | us | fast accum us | fast / plain | accumulation error plain | "
             "accumulation error fast | FP8 against bf16 |", "|---|---|---|---|---|---|---|---|---|---|"]
    results = []
    os.makedirs(args.out, exist_ok=True)
    for model in args.models.split(","):
        for name, (n, k) in SHAPES[model].items():
            w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
            wsc = [w.float().abs().amax(1, keepdim=True) / FP8_MAX for w in w16]
            wq = [(w.float() / s).to(FP8) for w, s in zip(w16, wsc)]
            for m in [int(r) for r in args.rows.split(",")]:
                if n <= k and m <= TENSORWISE_MAX_ROWS:
                    path = "tensorwise"
                elif m > ROWS_MAX:
                    path = "rowwise"
                else:
                    continue
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                x[:, torch.randperm(k, device=dev)[:8]] *= 20.0
                xq, xs = quantize_rows(x, k)
                cs = wsc[0].view(1, -1)

                def product(w, fast, xq=xq, xs=xs, cs=cs, path=path):
                    if path == "tensorwise":
                        return torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                                use_fast_accum=fast)
                    return torch._scaled_mm(xq, w.t(), scale_a=xs.view(-1, 1), scale_b=cs, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)

                exact = xq.double() @ wq[0].double().t()
                if path == "rowwise":
                    exact = exact * xs.double().view(-1, 1) * cs.double()
                plain_err = rms_rel(product(wq[0], False), exact)
                fast_err = rms_rel(product(wq[0], True), exact)
                scaled = exact if path == "rowwise" else exact * xs.double().view(-1, 1) * cs.double()
                quant_err = rms_rel(scaled, (x @ w16[0].t()).double())
                plain_us = graph_us([lambda w=w: product(w, False) for w in wq])
                fast_us = graph_us([lambda w=w: product(w, True) for w in wq])
                row = {"model": model, "product": name, "rows": m, "path": path, "us": plain_us,
                       "fast_us": fast_us, "plain_err": plain_err, "fast_err": fast_err, "fp8_vs_bf16": quant_err}
                results.append(row)
                line = (f"| {model} | {name} | {m} | {path} | {plain_us:.2f} | {fast_us:.2f} | "
                        f"{fast_us / plain_us:.3f} | {plain_err:.1e} | {fast_err:.1e} | {quant_err:.1e} |")
                print(line, flush=True)
                lines.append(line)
                with open(os.path.join(args.out, "fp8_fast_accum.md"), "w") as f:     # kept as it grows
                    f.write("\n".join(lines) + "\n")
    text = "\n".join(lines + ["", f"commit {os.environ.get('TOKENMILL_GIT_COMMIT', 'unknown')}, "
                                  f"{torch.cuda.get_device_name()}"])
    with open(os.path.join(args.out, "fp8_fast_accum.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "fp8_fast_accum.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
