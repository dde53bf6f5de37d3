"""FP8 products of 64-1,024 input rows (the mixed steps of a served batch): bf16 `F.linear`, the shipped
dispatch (`fp8_linear`), `quantize_rows` and `torch._scaled_mm` alone, and `fp8_rows` (its input rows in
blocks) at `rows_tile`'s tile and at each of TILES, each checked against the product of the row-quantized
input first.

    python lab/fp8_mid_rows.py --out DIR [--rows 64,128,...] [--models qwen3-4b,nanbeige4.1-3b]
                                           DIR/fp8_mid_rows.md (also printed), DIR/fp8_mid_rows.json

    python lab/fp8_mid_rows.py --block --rows 128,256,2048,8192 --out DIR  DIR/fp8_block_rows.md: 128 x 128
        block scales, `fp8_block_gemm` (at BLOCK_GEMM_TILES too) and `fp8_rows` against the dequantized
        layer and bf16

(The per-channel split-K W8A8 GEMM that `--gemm` timed against `_scaled_mm` is at commit 266464b; it lost,
docs/BENCHMARKS.md.)

On the CPU (`--check`, under the interpreter) it only checks the kernels on small shapes.
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

SHAPES = {"qwen3-4b": {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
          "nanbeige4.1-3b": {"qkv": (3584, 2560), "o_proj": (2560, 2560), "gate_up": (20992, 2560),
                             "down": (2560, 10496)}}
COPIES = 8
# fp8_rows tiles beside rows_tile's: (block_n, block_m, block_k, num_warps, num_stages), each at split 1, the
# split that fills the SMs once, half and twice that
TILES = ((64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (128, 128, 128, 8, 3),
         (64, 64, 256, 4, 3), (128, 64, 128, 8, 4))


# --block: `fp8_block_gemm` tiles (block_m, block_n, block_k, num_warps, num_stages) beside `gemm_tile`'s
BLOCK_GEMM_TILES = ((64, 128, 128, 4, 4), (64, 128, 128, 4, 3), (128, 128, 128, 8, 3), (64, 64, 128, 4, 4),
                    (128, 64, 128, 4, 4))


def tiles_for(n: int, m: int, sms: int):
    from tokenmill.layers.kernels.fp8_gemm import Fp8RowsTile
    for bn, bm, bk, warps, stages in TILES:
        fill = max(1, -(-sms // ((-(-n // bn)) * (-(-m // bm)))))
        for split in sorted({1, max(1, fill // 2), fill, 2 * fill}):
            yield Fp8RowsTile(bn, bk, warps, stages, split, bm)


def check_cpu():
    from tokenmill.layers.kernels.fp8_gemm import Fp8RowsTile, fp8_rows
    from tokenmill.layers.kernels.fp8_quantize import quantize_rows_torch
    from tokenmill.quant import fp8
    torch.manual_seed(0)
    for m, n, k in ((5, 96, 256), (70, 130, 384)):
        w = torch.randn(n, k) * 0.05
        q, s = fp8.quantize(w)
        x = torch.randn(m, k).bfloat16()
        xq, xs = quantize_rows_torch(x)
        want = (xq.float() * xs) @ fp8.dequantize(q, s, (1, k)).t()
        for split in (1, 3):
            got = fp8_rows(x, q, s, (1, k), tile=Fp8RowsTile(32, 64, 4, 2, split, 16)).float()
            err = ((got - want).abs().max() / want.abs().mean()).item()
            print(m, n, k, split, f"err {err:.4f}")
            assert err < 0.05


def bench(args):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "device"))
    from fp8_products import graph_us, write_report
    from tokenmill.layers.kernels.fp8_gemm import fp8_linear, fp8_rows, rows_tile
    from tokenmill.layers.kernels.fp8_quantize import quantize_rows
    from tokenmill.quant import fp8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [int(r) for r in args.rows.split(",")]
    lines = ["| model | product | M | bf16 | shipped | quantize_rows | _scaled_mm | fp8_rows, rows_tile | "
             "fp8_rows best | best tile | bf16 / shipped | bf16 / rows_tile | bf16 / best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    results = []
    for model in args.models.split(","):
        for name, (n, k) in SHAPES[model].items():
            ws = [torch.randn(n, k, device="cuda").mul_(0.05) for _ in range(COPIES)]
            bf = [w.bfloat16() for w in ws]
            qs = [fp8.quantize(w) for w in ws]
            w_ref = fp8.dequantize(*qs[0], (1, k)).t()
            blk = (1, k)
            for m in rows:
                x = torch.randn(m, k, device="cuda").bfloat16()
                xq, xs = quantize_rows(x)
                want = (xq.float() * xs) @ w_ref
                bf16 = graph_us([lambda w=w: F.linear(x, w) for w in bf])
                shipped = graph_us([lambda q=q: fp8_linear(x, *q, blk) for q in qs])
                quant = graph_us([lambda: quantize_rows(x)] * COPIES)
                smm = graph_us([lambda q=q: torch._scaled_mm(xq, q[0].t(), scale_a=xs, scale_b=q[1].view(1, -1),
                                                             out_dtype=torch.bfloat16) for q in qs])
                rule = rows_tile(n, blk, x.device, m)
                tiles = {}
                for tile in [rule] + [t for t in tiles_for(n, m, sms) if t != rule]:
                    got = fp8_rows(x, *qs[0], blk, tile=tile).float()
                    err = ((got - want).abs().max() / want.abs().mean()).item()
                    tiles[str(tile)] = graph_us([lambda q=q, t=tile: fp8_rows(x, *q, blk, tile=t) for q in qs]) \
                        if err < 0.05 else f"WRONG {err:.3f}"
                timed = {t: v for t, v in tiles.items() if isinstance(v, float)}
                best = min(timed, key=timed.get)
                at_rule = timed.get(str(rule), float("nan"))
                results.append(dict(model=model, product=name, n=n, k=k, m=m, bf16_us=bf16, shipped_us=shipped,
                                    quantize_us=quant, scaled_mm_us=smm, rule=str(rule), tiles=tiles))
                lines.append(f"| {model} | {name} | {m} | {bf16:.2f} | {shipped:.2f} | {quant:.2f} | {smm:.2f} | "
                             f"{at_rule:.2f} | {timed[best]:.2f} | {best.replace('Fp8RowsTile', '')} | "
                             f"{bf16 / shipped:.2f}x | {bf16 / at_rule:.2f}x | {bf16 / timed[best]:.2f}x |")
                print(lines[-1], flush=True)
            del ws, bf, qs
            torch.cuda.empty_cache()
    write_report(args.out, "fp8_mid_rows", lines, results)


def block_bench(args):
    """Block-scaled (128 x 128) weights: `fp8_block_gemm` at `gemm_tile`'s tile and at BLOCK_GEMM_TILES,
    `fp8_rows` at `rows_tile`'s, the dequantized layer (`fp8_linear_torch`) and bf16, each checked against
    the block-quantized input's product first."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "device"))
    from fp8_products import graph_us, write_report
    from tokenmill.layers.kernels.fp8_block_gemm import Fp8GemmTile, fp8_block_gemm, gemm_tile
    from tokenmill.layers.kernels.fp8_gemm import fp8_linear_torch, fp8_rows
    from tokenmill.layers.kernels.fp8_quantize import quantize_rows_torch
    from tokenmill.quant import fp8
    blk = (128, 128)
    rule = gemm_tile(blk)
    tiles = [rule] + [t for t in map(lambda t: Fp8GemmTile(*t), BLOCK_GEMM_TILES) if t != rule]
    lines = ["| product | M | bf16 | dequantized layer + bf16 | fp8_rows | fp8_block_gemm, gemm_tile | best gemm | "
             "best tile | bf16 / gemm_tile | fp8_rows / gemm_tile |", "|---|---|---|---|---|---|---|---|---|---|"]
    results = []
    for name, (n, k) in SHAPES["qwen3-4b"].items():
        ws = [torch.randn(n, k, device="cuda").mul_(0.05) for _ in range(4)]
        bf = [w.bfloat16() for w in ws]
        qs = [fp8.quantize(w, blk) for w in ws]
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, xs = quantize_rows_torch(x, 128)
            want = (xq.float().view(m, -1, 128) * xs[:, :, None]).view(m, k) @ fp8.dequantize(*qs[0], blk).t()

            def timed(fn, qs=qs):
                err = ((fn(*qs[0]).float() - want).abs().max() / want.abs().mean()).item()
                return graph_us([lambda q=q: fn(*q) for q in qs]) if err < 0.05 else float("nan")
            rows_us = timed(lambda q, s: fp8_rows(x, q, s, blk))
            gemm_us = {t: timed(lambda q, s, t=t: fp8_block_gemm(x, q, s, blk, tile=t)) for t in tiles}
            deq = graph_us([lambda q=q: fp8_linear_torch(x, *q, blk) for q in qs])
            bf16 = graph_us([lambda w=w: F.linear(x, w) for w in bf])
            best = min(gemm_us, key=lambda t: gemm_us[t] if gemm_us[t] == gemm_us[t] else float("inf"))
            results.append(dict(product=name, m=m, bf16=bf16, dequantized=deq, fp8_rows=rows_us,
                                gemm={str(t): v for t, v in gemm_us.items()}))
            lines.append(f"| {name} | {m} | {bf16:.1f} | {deq:.1f} | {rows_us:.1f} | {gemm_us[rule]:.1f} | "
                         f"{gemm_us[best]:.1f} | {tuple(best.__dict__.values())} | {bf16 / gemm_us[rule]:.2f}x | "
                         f"{rows_us / gemm_us[rule]:.2f}x |")
            print(lines[-1], flush=True)
        del ws, bf, qs
        torch.cuda.empty_cache()
    write_report(args.out, "fp8_block_rows", lines, results)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="64,128,192,256,384,512,1024")
    p.add_argument("--models", default="qwen3-4b")
    p.add_argument("--check", action="store_true")
    p.add_argument("--block", action="store_true", help="block-scaled weights: fp8_block_gemm and fp8_rows "
                   "against the dequantized layer")
    a = p.parse_args()
    check_cpu() if a.check else block_bench(a) if a.block else bench(a)
