"""FP8 products of 64-1,024 input rows (the mixed steps of a served batch): bf16 `F.linear`, the shipped
dispatch (`fp8_linear`), `quantize_rows` and `torch._scaled_mm` alone, and `fp8_rows` (its input rows in
blocks) at `rows_tile`'s tile and at each of TILES, each checked against the product of the row-quantized
input first.

    python lab/fp8_mid_rows.py --out DIR [--rows 64,128,...] [--models qwen3-4b,nanbeige4.1-3b]
                                           DIR/fp8_mid_rows.md (also printed), DIR/fp8_mid_rows.json

    python lab/fp8_mid_rows.py --block --rows 256,2048,8192 --out DIR      DIR/fp8_block_rows.md: 128 x 128
        block scales, `fp8_rows` against the dequantized layer and bf16

    python lab/fp8_mid_rows.py --gemm --rows 256,384,512,1024 --out DIR     DIR/fp8_gemm_split.md: a W8A8 GEMM
        with the input rows on the tensor cores' wide side and K split (`_gemm_kernel`, GEMM_TILES, the
        tensor cores' accumulation or float32 steps) against `_scaled_mm`, qwen3-4b's products

On the CPU (`TRITON_INTERPRET=1`, `--check`) it only checks the kernels on small shapes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.layers.kernels import split_k

SHAPES = {"qwen3-4b": {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
          "nanbeige4.1-3b": {"qkv": (3584, 2560), "o_proj": (2560, 2560), "gate_up": (20992, 2560),
                             "down": (2560, 10496)}}
COPIES = 8
# fp8_rows tiles beside rows_tile's: (block_n, block_m, block_k, num_warps, num_stages), each at split 1, the
# split that fills the SMs once, and twice that
TILES = ((64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (128, 128, 128, 8, 3),
         (64, 64, 256, 4, 3), (128, 64, 128, 8, 4))


# --gemm: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of `_gemm_kernel`, each at split 1, the split
# that fills the SMs once, and twice that; with the tensor cores' own accumulation and with each step's
# product added in float32
GEMM_TILES = ((128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (64, 128, 128, 4, 4), (128, 128, 64, 4, 4),
              (64, 256, 128, 8, 3))


@triton.jit
def _gemm_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, x_stride, w_stride,
                 out_stride, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, FAST_ACC: tl.constexpr):
    # W8A8 per channel, the input rows on the tensor cores' wide side (`fp8_rows` puts the weight rows
    # there); tile p: its input row blocks the fastest; split s of the K steps, gathered as in fp8_rows
    # with the roles of the two sides swapped (part [SPLIT, M, N])
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(M, BLOCK_M)
    rm = (pid % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid // m_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    k_begin, k_end = split_k.k_range(K, BLOCK_K, SPLIT)
    a_ptrs = xq_ptr + rm.to(tl.int64)[:, None] * x_stride
    b_ptrs = w_ptr + rn.to(tl.int64)[None, :] * w_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + rk
        a = tl.load(a_ptrs + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
        b = tl.load(b_ptrs + kk[:, None], mask=(kk < K)[:, None] & n_mask[None, :], other=0.0)
        if FAST_ACC:
            acc = tl.dot(a, b, acc)
        else:
            acc += tl.dot(a, b)
    acc, out_mask = split_k.gather(acc, m_mask[:, None] & n_mask[None, :], part_ptr, count_ptr, rm, rn, M, N,
                                   SPLIT)
    acc *= tl.load(xs_ptr + rm, mask=m_mask, other=0.0)[:, None] * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * out_stride + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=out_mask)


def gemm(xq, xs, weight, scale, tile, split, fast_acc, out_dtype=torch.bfloat16):
    """xq [M, K] FP8, xs [M, 1] float32, weight [N, K] FP8, scale [N] float32 -> [M, N]."""
    M, K = xq.shape
    N = weight.shape[0]
    bm, bn, bk, warps, stages = tile
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    part, count = split_k.scratch(xq.device, split, M, N, tiles)
    _gemm_kernel[(tiles, split)](xq, xs, weight, scale, out, part, count, M, N, K, xq.stride(0), weight.stride(0),
                                 out.stride(0), SPLIT=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                 NUM_STAGES=stages, FAST_ACC=fast_acc, num_warps=warps)
    return out


def gemm_bench(args):
    """`_gemm_kernel` at GEMM_TILES against `_scaled_mm` (both without the activations' quantization) and
    bf16, qwen3-4b's products, per channel."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "device"))
    from fp8_products import graph_us
    from tokenmill.layers.kernels.fp8_gemm import quantize_rows
    from tokenmill.quant import fp8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = ["| product | M | bf16 | _scaled_mm | gemm best (fast acc) | tile, split | gemm best (float32 steps) | "
             "tile, split | _scaled_mm / fast | _scaled_mm / float32 steps |", "|---|---|---|---|---|---|---|---|---|---|"]
    results = []
    for name, (n, k) in SHAPES["qwen3-4b"].items():
        ws = [torch.randn(n, k, device="cuda").mul_(0.05) for _ in range(COPIES)]
        bf = [w.bfloat16() for w in ws]
        qs = [fp8.quantize(w) for w in ws]
        w_ref = fp8.dequantize(*qs[0], (1, k)).t()
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, xs = quantize_rows(x)
            want = (xq.float() * xs) @ w_ref
            bf16 = graph_us([lambda w=w: F.linear(x, w) for w in bf])
            smm = graph_us([lambda q=q: torch._scaled_mm(xq, q[0].t(), scale_a=xs, scale_b=q[1].view(1, -1),
                                                         out_dtype=torch.bfloat16) for q in qs])
            best = {}
            for fast in (True, False):
                for tile in GEMM_TILES:
                    fill = max(1, -(-sms // (-(-m // tile[0]) * -(-n // tile[1]))))
                    for split in sorted({1, fill, 2 * fill}):
                        got = gemm(xq, xs, qs[0][0], qs[0][1].view(-1), tile, split, fast).float()
                        err = ((got - want).abs().max() / want.abs().mean()).item()
                        if err > 0.05:
                            print("WRONG", name, m, tile, split, fast, err, flush=True)
                            continue
                        us = graph_us([lambda q=q: gemm(xq, xs, q[0], q[1].view(-1), tile, split, fast) for q in qs])
                        results.append(dict(product=name, m=m, tile=tile, split=split, fast=fast, us=us, err=err))
                        if fast not in best or us < best[fast][0]:
                            best[fast] = (us, f"{tile}, {split}")
            f, p = best.get(True, (float("nan"), "-")), best.get(False, (float("nan"), "-"))
            lines.append(f"| {name} | {m} | {bf16:.2f} | {smm:.2f} | {f[0]:.2f} | {f[1]} | {p[0]:.2f} | {p[1]} | "
                         f"{smm / f[0]:.2f}x | {smm / p[0]:.2f}x |")
            print(lines[-1], flush=True)
        del ws, bf, qs
        torch.cuda.empty_cache()
    text = "\n".join(lines + ["", f"commit {os.environ.get('TOKENMILL_GIT_COMMIT', 'unknown')}, "
                                   f"{torch.cuda.get_device_name()}"])
    print(text)
    with open(os.path.join(args.out, "fp8_gemm_split.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "fp8_gemm_split.json"), "w") as f:
        json.dump(results, f, indent=1)


def tiles_for(n: int, m: int, sms: int):
    from tokenmill.layers.kernels.fp8_gemm import Fp8RowsTile
    for bn, bm, bk, warps, stages in TILES:
        fill = max(1, -(-sms // ((-(-n // bn)) * (-(-m // bm)))))
        for split in sorted({1, fill, 2 * fill}):
            yield Fp8RowsTile(bn, bk, warps, stages, split, bm)


def check_cpu():
    from tokenmill.layers.kernels.fp8_gemm import Fp8RowsTile, fp8_rows, quantize_rows_torch
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
            for fast in (True, False):
                got = gemm(xq, xs, q, s.view(-1), (16, 32, 64, 4, 2), split, fast).float()
                err = ((got - want).abs().max() / want.abs().mean()).item()
                print(m, n, k, split, "gemm", fast, f"err {err:.4f}")
                assert err < 0.05


def bench(args):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "device"))
    from fp8_products import graph_us
    from tokenmill.layers.kernels.fp8_gemm import fp8_linear, fp8_rows, quantize_rows, rows_tile
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
    lines += ["", f"commit {os.environ.get('TOKENMILL_GIT_COMMIT', 'unknown')}, {torch.cuda.get_device_name()}"]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "fp8_mid_rows.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "fp8_mid_rows.json"), "w") as f:
        json.dump(results, f, indent=1)


def block_bench(args):
    """Block-scaled (128 x 128) weights at many rows: `fp8_rows` at `rows_tile`'s tile against the
    dequantized layer (`fp8_linear_torch`) and bf16, each checked first."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "device"))
    from fp8_products import graph_us
    from tokenmill.layers.kernels.fp8_gemm import fp8_linear_torch, fp8_rows, quantize_rows_torch
    from tokenmill.quant import fp8
    blk = (128, 128)
    lines = ["| product | M | bf16 | dequantized layer + bf16 | fp8_rows | dequantized / fp8_rows | bf16 / fp8_rows |",
             "|---|---|---|---|---|---|---|"]
    for name, (n, k) in SHAPES["qwen3-4b"].items():
        ws = [torch.randn(n, k, device="cuda").mul_(0.05) for _ in range(4)]
        bf = [w.bfloat16() for w in ws]
        qs = [fp8.quantize(w, blk) for w in ws]
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, xs = quantize_rows_torch(x, 128)
            want = (xq.float().view(m, -1, 128) * xs[:, :, None]).view(m, k) @ fp8.dequantize(*qs[0], blk).t()
            got = fp8_rows(x, *qs[0], blk).float()
            err = ((got - want).abs().max() / want.abs().mean()).item()
            rows_us = graph_us([lambda q=q: fp8_rows(x, *q, blk) for q in qs]) if err < 0.05 else float("nan")
            deq = graph_us([lambda q=q: fp8_linear_torch(x, *q, blk) for q in qs])
            bf16 = graph_us([lambda w=w: F.linear(x, w) for w in bf])
            lines.append(f"| {name} | {m} | {bf16:.1f} | {deq:.1f} | {rows_us:.1f} (err {err:.4f}) | "
                         f"{deq / rows_us:.2f}x | {bf16 / rows_us:.2f}x |")
            print(lines[-1], flush=True)
        del ws, bf, qs
        torch.cuda.empty_cache()
    text = "\n".join(lines + ["", f"commit {os.environ.get('TOKENMILL_GIT_COMMIT', 'unknown')}, "
                                   f"{torch.cuda.get_device_name()}"])
    print(text)
    with open(os.path.join(args.out, "fp8_block_rows.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="64,128,192,256,384,512,1024")
    p.add_argument("--models", default="qwen3-4b")
    p.add_argument("--check", action="store_true")
    p.add_argument("--block", action="store_true", help="block-scaled weights: fp8_rows against the dequantized layer")
    p.add_argument("--gemm", action="store_true", help="the split-K W8A8 GEMM (input rows on the wide side) "
                   "against _scaled_mm")
    a = p.parse_args()
    check_cpu() if a.check else block_bench(a) if a.block else gemm_bench(a) if a.gemm else bench(a)
