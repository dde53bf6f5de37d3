"""Each qwen3-4b and nanbeige4.1-3b ("nb") decoder product at one row with 4-bit (AWQ-layout, group 128) weights
against bf16 (scripts/device/bench_w4.sh's `products` stage runs it):

  python scripts/device/w4_products.py --out DIR      DIR/w4_products.md (also printed)

Per shape: bf16's single-token product (`gemv.fused_linear`, shipped tile), the 4-bit few-row GEMV
(`w4_gemm.w4_linear`, without SiLU-and-mul), the 4-bit single-token product as shipped (`gemv.fused_linear`
with the words, SiLU-and-mul folded into gate_up as for bf16) and with each of CANDIDATES' tiles.
Microseconds per product inside one CUDA graph over COPIES weight copies (weights from HBM), each checked
against the dequantized float32 product first. The fastest tile per shape, where it beats the shipped one by
over 3%, goes to DIR/w4_best_tiles.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from fp8_products import COPIES, SHAPES, SILU, graph_us, write_report  # noqa: E402

GROUP = 128


def candidates():
    from tokenmill.layers.kernel_config import WholeRowTile
    return [WholeRowTile(bn, w, p) for bn, w, p in (
        (4, 4, 4), (4, 4, 6), (8, 4, 3), (8, 4, 4), (8, 4, 5), (16, 4, 2), (16, 4, 3), (8, 8, 2), (4, 16, 2),
        (8, 16, 1))]


def random_w4(n: int, k: int):
    # `repack_w4`'s tensors with random words, scales and zeros
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    scales = (torch.rand(n, k // GROUP, device="cuda") * 0.01 + 0.002).half()
    zeros = torch.randint(0, 16, (n, k // GROUP), dtype=torch.uint8, device="cuda")
    return qweight, scales, zeros


def main(args) -> None:
    from tokenmill.layers.kernels import gemv, w4_gemm
    from tokenmill.layers.quantized import dequantize_w4

    lines = ["## 4-bit single-token products vs bf16 (us per product, one row, weights from HBM)", "",
             "| product | bf16 us | W4 GEMV us (no SiLU) | W4 single-token shipped us | best tile | best us | "
             "bf16 / W4 shipped |", "|---|---|---|---|---|---|---|"]
    sweep, best_tiles = {}, []
    for name, (n, k) in SHAPES.items():
        silu = SILU.get(name, False)
        ws = [random_w4(n, k) for _ in range(COPIES)]
        bf = [dequantize_w4(*w, GROUP).bfloat16() for w in ws]
        x = torch.randn(1, k, device="cuda").bfloat16()
        ref = x.float() @ dequantize_w4(*ws[0], GROUP).t()
        if silu:
            ref = F.silu(ref[:, :n // 2]) * ref[:, n // 2:]

        def single(w, tile=None):
            q, s, z = w
            return gemv.fused_linear(x, q, weight_scale=s, weight_zeros=z, weight_block=(1, GROUP), silu=silu,
                                     tile=tile)[0]
        err = ((single(ws[0]).float() - ref).abs().max() / ref.abs().max()).item()
        if err > 0.02:
            raise SystemExit(f"{name}: the shipped 4-bit single-token product errs by {err:.4f} of its largest output")
        bf16_us = graph_us([lambda w=w: gemv.fused_linear(x, w, silu=silu)[0] for w in bf])
        gemv_us = graph_us([lambda w=w: w4_gemm.w4_linear(x, w[0], w[1], w[2], None, GROUP) for w in ws])
        shipped = graph_us([lambda w=w: single(w) for w in ws])
        sweep[name] = swept = {}
        for tile in candidates():
            try:
                got = single(ws[0], tile).float()
                if (got - ref).abs().max() / ref.abs().max() > 0.02:
                    swept[repr(tile)] = "WRONG"
                    continue
                swept[repr(tile)] = graph_us([lambda w=w, t=tile: single(w, t) for w in ws])
            except Exception as e:       # a tile that does not fit the shape: named, not fatal
                swept[repr(tile)] = f"ERROR {type(e).__name__}: {str(e)[:100]}"
        timed = {t: v for t, v in swept.items() if isinstance(v, float)}
        best = min(timed, key=timed.get)
        if timed[best] < shipped / 1.03:
            best_tiles.append([[n, k, silu], best])
        lines.append(f"| {name} {n}x{k}{' SiLU' if silu else ''} | {bf16_us:.2f} | {gemv_us:.2f} | {shipped:.2f} | "
                     f"{best} | {timed[best]:.2f} | {bf16_us / shipped:.2f}x |")
        print(lines[-1], flush=True)
        del ws, bf
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "w4_best_tiles.json"), "w") as f:
        json.dump(best_tiles, f)
    write_report(args.out, "w4_products", lines, sweep)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    main(p.parse_args())
