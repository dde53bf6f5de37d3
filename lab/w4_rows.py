"""A W4A16 product of 2-64 input rows on the tensor cores, to measure against the shipped path
(`w4_gemm.w4_linear`: more than GEMV_ROWS rows dequantize the whole layer into a scratch, then cuBLAS), in
the form that `fp8_gemm.fp8_rows` took for FP8: the weight rows on the MMA's 64-row side, the input rows on
the narrow one, K split so that the row blocks fill the SMs, the partials added in split order by a row
block's last split. Each step unpacks a [BLOCK_N, BLOCK_K] tile of 4-bit words in registers, (q - z) * s
in float32 rounded to x's dtype (as `dequantize_w4(...).to(dtype)`), and multiplies it with x^T.

    python lab/w4_rows.py check                 CPU (the interpreter, as the kernel tests run it): against
                                                the dequantized product, float32
    python lab/w4_rows.py bench --out DIR       GPU: qwen3-4b products, M in 2..128, us per product in a CUDA
                                                graph: bf16, w4_linear as shipped, this kernel's tiles
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if __name__ == "__main__" and sys.argv[1:2] == ["check"] and not torch.cuda.is_available():
    # the kernel tests' interpreter set-up (TRITON_INTERPRET and its patches), before Triton is imported
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "kernels"))
    __import__("conftest")

import triton
import triton.language as tl

from tokenmill.layers.kernels import split_k
from tokenmill.layers.kernels.gemv import _num_sms

@triton.jit
def _w4_rows_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, x_stride,
                    out_stride, GROUPS, SPLIT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    BW: tl.constexpr = BLOCK_K // 8
    jj = tl.arange(0, BW)
    i = tl.arange(0, 8)
    c = tl.arange(0, BLOCK_K)
    row_mask, m_mask = rows < N, m < M
    KW = K // 8
    k_begin, k_end = split_k.k_range(K, BLOCK_K, SPLIT)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * KW
    x_cols = x_ptr + m.to(tl.int64)[None, :] * x_stride
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        wv = k0 // 8 + jj
        ok = row_mask[:, None] & (wv < KW)[None, :]
        words = tl.load(w_rows + wv[None, :], mask=ok, other=0)
        g = rows * GROUPS + k0 // GROUP       # a step lies within one group (GROUP % BLOCK_K == 0)
        s = tl.load(s_ptr + g, mask=row_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g, mask=row_mask, other=0).to(tl.int32)
        q = (words[:, :, None] >> (4 * i)[None, None, :]) & 0xF
        w = ((q - z[:, None, None]).to(tl.float32) * s[:, None, None]).to(dtype)
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
        kk = k0 + c
        x = tl.load(x_cols + kk[:, None], mask=(kk < K)[:, None] & m_mask[None, :], other=0.0)
        acc += tl.dot(w, x)
    acc, out_mask = split_k.gather(acc, row_mask[:, None] & m_mask[None, :], part_ptr, count_ptr, rows, m, N,
                                   BLOCK_M, SPLIT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + m.to(tl.int64)[None, :] * out_stride + rows[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=out_mask)


def w4_rows(x, qweight, scales, zeros, bias, group_size, block_n=64, block_k=128, num_warps=4, num_stages=3,
            split=None):
    """x [M <= 64, K] @ W^T (+ bias) in x's dtype, W as `quantized.repack_w4`'s tensors."""
    M, K = x.shape
    N = qweight.shape[0]
    assert M <= 64 and group_size % block_k == 0 and x.stride(1) == 1
    blocks = triton.cdiv(N, block_n)
    split = split or max(1, triton.cdiv(_num_sms(x.device), blocks))
    block_m = max(16, triton.next_power_of_2(M))
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    part, count = split_k.scratch(x.device, split, N, block_m, blocks)
    _w4_rows_kernel[(blocks, split)](
        x, qweight, scales, zeros, bias if bias is not None else out, out, part, count, M, N, K, x.stride(0),
        out.stride(0), scales.shape[1], SPLIT=split, GROUP=group_size, BLOCK_N=block_n, BLOCK_M=block_m,
        BLOCK_K=block_k, NUM_STAGES=num_stages, HAS_BIAS=bias is not None, num_warps=num_warps)
    return out


def _layer(n, k, group, device, seed=0):
    from tokenmill.layers.quantized import dequantize_w4
    from tokenmill.quant.quantize import pack_cols
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 0.001).half()
    zeros = torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8)
    qweight = pack_cols(q).contiguous()
    to = lambda t: t.to(device)
    qweight, scales, zeros = to(qweight), to(scales), to(zeros)
    return qweight, scales, zeros, dequantize_w4(qweight, scales, zeros, group)


def check() -> None:
    for m, split, bias in ((1, 1, False), (5, 3, True), (17, 1, False), (17, 2, True)):
        qweight, scales, zeros, w = _layer(136, 512, 128, "cpu")
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(1))
        b = torch.randn(136) if bias else None
        got = w4_rows(x, qweight, scales, zeros, b, 128, block_n=64, block_k=64, num_stages=2, split=split)
        want = x @ w.t() + (0 if b is None else b)
        err = ((got - want).abs().max() / want.abs().mean()).item()
        print(f"M={m} split={split} bias={bias}: max error / mean {err:.2e}")
        assert err < 1e-4


def bench(out_dir: str) -> None:
    import torch.nn.functional as F
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "device"))
    from fp8_products import graph_us
    from tokenmill.layers.kernels.w4_gemm import w4_linear
    shapes = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
    tiles = [dict(block_n=64, block_k=128, num_warps=4, num_stages=3), dict(block_n=64, block_k=128, num_warps=4,
             num_stages=4), dict(block_n=128, block_k=128, num_warps=8, num_stages=3)]
    lines = ["| product | M | bf16 us | w4_linear us | w4_rows best us | tile | w4_linear / best | bf16 / best |",
             "|---|---|---|---|---|---|---|---|"]
    results = []
    for name, (n, k) in shapes.items():
        layers = [_layer(n, k, 128, "cuda", seed) for seed in range(8)]
        bf = [w.bfloat16() for *_, w in layers]
        layers = [(q, s, z) for q, s, z, _ in layers]
        for m in (2, 4, 8, 16, 32, 64, 128):
            x = torch.randn(m, k, device="cuda").bfloat16()
            want = x.float() @ bf[0].float().t()
            timed = {}
            for t in tiles:
                got = w4_rows(x, *layers[0], None, 128, **t).float()
                err = ((got - want).abs().max() / want.abs().mean()).item()
                timed[repr(t)] = graph_us([lambda L=L, t=t: w4_rows(x, *L, None, 128, **t) for L in layers]) \
                    if err < 0.02 else f"WRONG {err:.3f}"
            shipped = graph_us([lambda L=L: w4_linear(x, *L, None, 128) for L in layers])
            bf16 = graph_us([lambda w=w: F.linear(x, w) for w in bf])
            ok = {t: v for t, v in timed.items() if isinstance(v, float)}
            best = min(ok, key=ok.get) if ok else None
            results.append(dict(product=name, m=m, bf16_us=bf16, w4_linear_us=shipped, tiles=timed))
            lines.append(f"| {name} | {m} | {bf16:.2f} | {shipped:.2f} | " + (
                f"{ok[best]:.2f} | {best} | {shipped / ok[best]:.2f}x | {bf16 / ok[best]:.2f}x |" if best
                else "- | none | - | - |"))
            print(lines[-1], flush=True)
        del layers, bf
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out_dir, "w4_rows.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, "w4_rows.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["check", "bench"])
    p.add_argument("--out", default=".")
    a = p.parse_args()
    check() if a.cmd == "check" else bench(a.out)
