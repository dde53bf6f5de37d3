"""FP8 products of 64-2,048 input rows (the mixed steps of a served batch): bf16 `F.linear`, the shipped
W8A8 path (`quantize_rows` + `torch._scaled_mm` above 64 rows), `_scaled_mm` alone, and a Triton W8A8 GEMM
with several tiles, each checked against the product of the row-quantized input first.

    python lab/fp8_mid_rows.py --out DIR [--rows 64,128,...] [--models qwen3-4b,nanbeige4.1-3b]
                                           DIR/fp8_mid_rows.md (also printed), DIR/fp8_mid_rows.json

On the CPU (`TRITON_INTERPRET=1`, `--check`) it only checks the kernel on small shapes.
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

SHAPES = {"qwen3-4b": {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
          "nanbeige4.1-3b": {"qkv": (3584, 2560), "o_proj": (2560, 2560), "gate_up": (20992, 2560),
                             "down": (2560, 10496)}}
COPIES = 8
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = ((64, 128, 128, 4, 4), (64, 256, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3),
         (64, 128, 256, 4, 3), (128, 128, 64, 4, 5))


@triton.jit
def _fp8_gemm_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
    # out[m, n] = xs[m] * s[n] * sum_k xq[m, k] w[n, k]; programs along M fastest, so that the few row
    # blocks sharing a weight column block run together and read it from L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % num_m, pid // num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    x_ptrs = xq_ptr + rm.to(tl.int64)[:, None] * x_stride + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * w_stride + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
        b = tl.load(w_ptrs + k0, mask=n_mask[None, :], other=0.0)
        acc += tl.dot(a, b)
    acc *= tl.load(xs_ptr + rm, mask=m_mask, other=0.0)[:, None] * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * out_stride + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def fp8_gemm(xq, xs, weight, scale, tile, out_dtype=torch.bfloat16):
    M, K = xq.shape
    N = weight.shape[0]
    bm, bn, bk, warps, stages = tile
    assert K % bk == 0
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _fp8_gemm_kernel[grid](xq, xs, weight, scale, out, M, N, K, xq.stride(0), weight.stride(0), out.stride(0),
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps)
    return out


def check_cpu():
    from tokenmill.layers.kernels.fp8_gemm import quantize_rows_torch
    from tokenmill.quant import fp8
    torch.manual_seed(0)
    for m, n, k in ((5, 96, 256), (70, 130, 384)):
        w = torch.randn(n, k) * 0.05
        q, s = fp8.quantize(w)
        x = torch.randn(m, k).bfloat16()
        xq, xs = quantize_rows_torch(x)
        want = (xq.float() * xs) @ fp8.dequantize(q, s, (1, k)).t()
        got = fp8_gemm(xq, xs, q, s.view(-1), (16, 32, 32, 4, 2)).float()
        err = ((got - want).abs().max() / want.abs().mean()).item()
        print(m, n, k, f"err {err:.4f}")
        assert err < 0.05


def bench(args):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "device"))
    from fp8_products import graph_us
    from tokenmill.layers.kernels.fp8_gemm import fp8_linear, quantize_rows
    from tokenmill.quant import fp8
    rows = [int(r) for r in args.rows.split(",")]
    lines = ["| model | product | M | bf16 | shipped (quantize + _scaled_mm) | quantize_rows | _scaled_mm | "
             "Triton best (+ quantize) | best tile | bf16 / shipped | bf16 / Triton+q |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    results = []
    for model in args.models.split(","):
        for name, (n, k) in SHAPES[model].items():
            ws = [torch.randn(n, k, device="cuda").mul_(0.05) for _ in range(COPIES)]
            bf = [w.bfloat16() for w in ws]
            qs = [fp8.quantize(w) for w in ws]
            w_ref = fp8.dequantize(*qs[0], (1, k)).t()
            for m in rows:
                x = torch.randn(m, k, device="cuda").bfloat16()
                xq, xs = quantize_rows(x)
                want = (xq.float() * xs) @ w_ref
                bf16 = graph_us([lambda w=w: F.linear(x, w) for w in bf])
                shipped = graph_us([lambda q=q: fp8_linear(x, *q, (1, k)) for q in qs])
                quant = graph_us([lambda: quantize_rows(x)] * COPIES)
                smm = graph_us([lambda q=q: torch._scaled_mm(xq, q[0].t(), scale_a=xs, scale_b=q[1].view(1, -1),
                                                             out_dtype=torch.bfloat16) for q in qs])
                tiles = {}
                for tile in TILES:
                    got = fp8_gemm(xq, xs, qs[0][0], qs[0][1].view(-1), tile).float()
                    err = ((got - want).abs().max() / want.abs().mean()).item()
                    tiles[str(tile)] = graph_us([lambda q=q, t=tile: fp8_gemm(xq, xs, q[0], q[1].view(-1), t)
                                                 for q in qs]) if err < 0.05 else f"WRONG {err:.3f}"
                timed = {t: v for t, v in tiles.items() if isinstance(v, float)}
                best = min(timed, key=timed.get) if timed else None
                tq = timed[best] + quant if best else float("nan")
                results.append(dict(model=model, product=name, n=n, k=k, m=m, bf16_us=bf16, shipped_us=shipped,
                                    quantize_us=quant, scaled_mm_us=smm, tiles=tiles))
                lines.append(f"| {model} | {name} | {m} | {bf16:.2f} | {shipped:.2f} | {quant:.2f} | {smm:.2f} | "
                             f"{tq:.2f} | {best} | {bf16 / shipped:.2f}x | {bf16 / tq:.2f}x |")
                print(lines[-1], tiles, flush=True)
            del ws, bf, qs
            torch.cuda.empty_cache()
    lines += ["", f"commit {os.environ.get('TOKENMILL_GIT_COMMIT', 'unknown')}, {torch.cuda.get_device_name()}"]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "fp8_mid_rows.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "fp8_mid_rows.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="64,128,192,256,384,512,1024,2048")
    p.add_argument("--models", default="qwen3-4b")
    p.add_argument("--check", action="store_true")
    a = p.parse_args()
    check_cpu() if a.check else bench(a)
