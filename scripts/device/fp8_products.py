"""Each qwen3-4b decoder product with FP8 weights against bf16, by rows (scripts/device/bench_fp8.sh runs it):

  python scripts/device/fp8_products.py --out DIR      DIR/fp8_products.md (also printed)

Per shape and M input rows: bf16 (M = 1: the single-token product `gemv.fused_linear`; else `F.linear`),
FP8 as shipped (`fp8_linear`; M = 1: `gemv.fused_linear` with the scales), and for M <= FEW_ROWS also the
W8A8 path (`quantize_rows` + `_scaled_mm`) that larger batches take, so that the few-row kernel's range can
be judged. Microseconds per product inside one CUDA graph over COPIES weight copies (weights from HBM),
checked against the dequantized float32 product before being timed.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
ROWS = (1, 2, 4, 8, 16, 64)
COPIES = 8


def graph_us(fns, reps: int = 20) -> float:
    """Mean microseconds of one call of fns (run in turn) inside a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / reps / len(fns)


def main(args) -> None:
    from tokenmill.layers.kernels import gemv
    from tokenmill.layers.kernels.fp8_gemm import FEW_ROWS, fp8_linear, quantize_rows
    from tokenmill.quant import fp8

    lines = ["## FP8 products vs bf16, qwen3-4b shapes (us per product, weights from HBM)", "",
             "| product | M | bf16 us | fp8 shipped us | fp8 W8A8 us | bf16 / fp8 shipped |", "|---|---|---|---|---|---|"]
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda").mul_(0.05) for _ in range(COPIES)]
        qs = [fp8.quantize(w) for w in ws]
        bf = [w.bfloat16() for w in ws]
        del ws
        for m in ROWS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            if m == 1:
                bf16_fn = lambda w: gemv.fused_linear(x, w)[0]
                fp8_fn = lambda q, s: gemv.fused_linear(x, q, weight_scale=s, weight_block=(1, k))[0]
            else:
                bf16_fn = lambda w: F.linear(x, w)
                fp8_fn = lambda q, s: fp8_linear(x, q, s, (1, k))

            def w8a8(q, s):
                xq, xs = quantize_rows(x)
                return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=x.dtype)
            want = x.float() @ fp8.dequantize(*qs[0], (1, k)).t()
            for label, fn in (("fp8 shipped", fp8_fn), ("W8A8", w8a8)):
                err = ((fn(*qs[0]).float() - want).abs().max() / want.abs().mean()).item()
                if err > 0.1:
                    raise SystemExit(f"{name} M={m} {label}: relative error {err:.3f}")
            bf16_us = graph_us([lambda w=w: bf16_fn(w) for w in bf])
            fp8_us = graph_us([lambda q=q: fp8_fn(*q) for q in qs])
            w8a8_us = graph_us([lambda q=q: w8a8(*q) for q in qs]) if 1 < m <= FEW_ROWS else None
            lines.append(f"| {name} {n}x{k} | {m} | {bf16_us:.2f} | {fp8_us:.2f} | "
                         f"{'-' if w8a8_us is None else f'{w8a8_us:.2f}'} | {bf16_us / fp8_us:.2f}x |")
        del qs, bf
        torch.cuda.empty_cache()
    lines += ["", f"M = 1: single-token products; 1 < M <= {FEW_ROWS}: the few-row W8A16 kernel (shipped) "
              "beside W8A8; larger M: W8A8 (shipped)"]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "fp8_products.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    main(p.parse_args())
