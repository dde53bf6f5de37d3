"""FP8 products of 64-256 input rows by stream-K: every input row in one tile (the weight read once), the
(weight row block, K step) units shared out evenly over a fixed number of programs, the tiles a program
shares with its neighbours finished by the last to arrive. Weights and inputs read by TMA descriptors or
by pointer loads. Timed against bf16's `F.linear` and the shipped `fp8_linear` on the four products of a
layer, inside a CUDA graph over 8 weight copies (as `lab/fp8_mid_rows.py`).

    python lab/fp8_streamk.py --out DIR [--rows 64,128,192,256] [--models qwen3-4b,nanbeige4.1-3b]
    python lab/fp8_streamk.py --check          # CPU: the kernels under the interpreter on small shapes
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

if __name__ == "__main__" and "--check" in sys.argv and not torch.cuda.is_available():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "kernels"))
    __import__("conftest")

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

SHAPES = {"qwen3-4b": {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
          "nanbeige4.1-3b": {"qkv": (3584, 2560), "o_proj": (2560, 2560), "gate_up": (20992, 2560),
                             "down": (2560, 10496)}}
COPIES = 8
# (block_n, block_k, num_stages, num_warps, programs an SM, tma)
VARIANTS = ((64, 128, 4, 4, 1, True), (64, 128, 4, 8, 1, True), (64, 128, 6, 8, 1, True),
            (64, 256, 3, 8, 1, True), (128, 128, 3, 8, 1, True), (64, 64, 8, 8, 1, True),
            (64, 128, 3, 8, 2, True), (64, 64, 4, 4, 2, True), (64, 64, 6, 4, 2, True),
            (64, 128, 4, 8, 1, False), (64, 64, 4, 4, 2, False), (64, 128, 4, 4, 1, False))


@triton.jit
def _fp8_sk_kernel(x_desc, w_desc, x_ptr, w_ptr, xs_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                   x_stride, w_stride, out_stride, K_STEPS, PER, MAXC, BLOCK_N: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, TMA: tl.constexpr):
    # units u = nb * K_STEPS + ks over [0, n_blocks * K_STEPS); program p takes [p * PER, (p + 1) * PER).
    # A tile whose units fall to several programs: each writes its partial sums to its slot of the
    # scratch, and the last to arrive adds the slots in order (deterministic) and stores the rows.
    pid = tl.program_id(0)
    total = tl.cdiv(N, BLOCK_N) * K_STEPS
    u = pid * PER
    end = tl.minimum(u + PER, total)
    m = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_K)
    m_mask = m < M
    xs = tl.load(xs_ptr + m, mask=m_mask, other=0.0)
    while u < end:
        nb = u // K_STEPS
        tile_end = (nb + 1) * K_STEPS
        stop = tl.minimum(end, tile_end)
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for ks in tl.range(u - nb * K_STEPS, stop - nb * K_STEPS, num_stages=NUM_STAGES):
            if TMA:
                w = w_desc.load([nb * BLOCK_N, ks * BLOCK_K])
                x = x_desc.load([0, ks * BLOCK_K])
            else:
                kk = ks * BLOCK_K + c
                w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * w_stride + kk[None, :],
                            mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
                x = tl.load(x_ptr + m.to(tl.int64)[:, None] * x_stride + kk[None, :],
                            mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
            acc += tl.dot(w, x.T)
        out_mask = row_mask[:, None] & m_mask[None, :]
        whole = (u == nb * K_STEPS) & (stop == tile_end)
        if not whole:
            first = (nb * K_STEPS) // PER
            n_contrib = (tile_end - 1) // PER - first + 1
            tile = (nb * MAXC).to(tl.int64) * BLOCK_N * BLOCK_M + \
                tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + m[None, :]
            tl.store(part_ptr + tile + (pid - first) * BLOCK_N * BLOCK_M, acc)
            tl.debug_barrier()
            last = tl.atomic_add(count_ptr + nb, 1, sem="acq_rel") == n_contrib - 1
            out_mask &= last
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            if last:
                for i in range(n_contrib):
                    acc += tl.load(part_ptr + tile + i * BLOCK_N * BLOCK_M, cache_modifier=".cg")
                tl.store(count_ptr + nb, 0)
        acc *= xs[None, :] * tl.load(s_ptr + rows, mask=row_mask, other=0.0)[:, None]
        tl.store(out_ptr + m.to(tl.int64)[None, :] * out_stride + rows[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=out_mask)
        u = stop


_SCRATCH: dict = {}


def fp8_streamk(xq, xs, weight, scale, out_dtype, variant, sms):
    """xq [M, K] FP8 with per-row scales xs [M, 1]; weight [N, K] FP8 with per-channel scale [N, 1]."""
    block_n, block_k, stages, warps, per_sm, tma = variant
    M, K = xq.shape
    N = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(M))
    k_steps = triton.cdiv(K, block_k)
    total = triton.cdiv(N, block_n) * k_steps
    programs = min(total, sms * per_sm)
    per = triton.cdiv(total, programs)
    programs = triton.cdiv(total, per)
    maxc = triton.cdiv(k_steps, per) + 1
    key = (xq.device, triton.cdiv(N, block_n), maxc, block_n, block_m)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(triton.cdiv(N, block_n) * maxc * block_n * block_m, dtype=torch.float32,
                                     device=xq.device),
                         torch.zeros(triton.cdiv(N, block_n), dtype=torch.int32, device=xq.device))
    part, count = _SCRATCH[key]
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    x_desc = TensorDescriptor.from_tensor(xq, [block_m, block_k]) if tma else xq
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k]) if tma else weight
    _fp8_sk_kernel[(programs,)](x_desc, w_desc, xq, weight, xs, scale, out, part, count, M, N, K, xq.stride(0),
                                weight.stride(0), out.stride(0), k_steps, per, maxc, BLOCK_N=block_n,
                                BLOCK_M=block_m, BLOCK_K=block_k, NUM_STAGES=stages, TMA=tma, num_warps=warps)
    return out


def check_cpu():
    from tokenmill.layers.kernels.fp8_gemm import quantize_rows_torch
    from tokenmill.quant import fp8
    torch.manual_seed(0)
    for m, n, k, variant, sms in ((5, 96, 256, (32, 64, 2, 4, 1, False), 3), (40, 130, 384, (32, 64, 2, 4, 1, False), 4),
                                  (40, 128, 384, (32, 64, 2, 4, 2, True), 2), (17, 64, 640, (16, 32, 2, 4, 1, True), 7)):
        w = torch.randn(n, k) * 0.05
        q, s = fp8.quantize(w)
        x = torch.randn(m, k).bfloat16()
        xq, xs = quantize_rows_torch(x)
        want = (xq.float() * xs) @ fp8.dequantize(q, s, (1, k)).t()
        got = fp8_streamk(xq, xs, q, s, torch.bfloat16, variant, sms).float()
        err = ((got - want).abs().max() / want.abs().mean()).item()
        print(m, n, k, variant, f"err {err:.4f}")
        assert err < 0.05


def bench(args):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "device"))
    from fp8_products import graph_us, write_report
    from tokenmill.layers.kernels.fp8_gemm import fp8_linear, quantize_rows
    from tokenmill.quant import fp8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [int(r) for r in args.rows.split(",")]
    results, sums = [], {}
    lines = ["| model | product | M | bf16 | shipped FP8 | quantize_rows | best stream-K (+quantize) | best variant | "
             "bf16 / shipped | bf16 / stream-K |", "|---|---|---|---|---|---|---|---|---|---|"]
    t0 = time.time()
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
                timed = {}
                for v in VARIANTS:
                    try:
                        got = fp8_streamk(xq, xs, *qs[0], torch.bfloat16, v, sms).float()
                        err = ((got - want).abs().max() / want.abs().mean()).item()
                        timed[v] = graph_us([lambda q=q, v=v: fp8_streamk(xq, xs, *q, torch.bfloat16, v, sms)
                                             for q in qs]) if err < 0.05 else f"WRONG {err:.3f}"
                    except Exception as e:     # a tile that does not fit shared memory or registers
                        timed[v] = f"{type(e).__name__}: {str(e)[:80]}"
                ok = {v: t for v, t in timed.items() if isinstance(t, float)}
                best = min(ok, key=ok.get) if ok else None
                sk = ok[best] + quant if best else float("nan")
                results.append(dict(model=model, product=name, n=n, k=k, m=m, bf16_us=bf16, shipped_us=shipped,
                                    quantize_us=quant, variants={str(v): t for v, t in timed.items()}))
                for key, val in (("bf16", bf16), ("shipped", shipped), ("sk", sk)):
                    sums[(model, m, key)] = sums.get((model, m, key), 0.0) + val
                for v, t in ok.items():
                    sums[(model, m, v)] = sums.get((model, m, v), 0.0) + t + quant
                lines.append(f"| {model} | {name} | {m} | {bf16:.2f} | {shipped:.2f} | {quant:.2f} | {sk:.2f} | "
                             f"{best} | {bf16 / shipped:.2f}x | {bf16 / sk:.2f}x |")
                print(lines[-1], f"({time.time() - t0:.0f} s)", flush=True)
            del ws, bf, qs
            torch.cuda.empty_cache()
    lines += ["", "A layer's four products (us): bf16, shipped, each product at its best variant, and the best "
              "single variant for all four", "",
              "| model | M | bf16 | shipped | stream-K, best each | best one variant | it | bf16 / best each |",
              "|---|---|---|---|---|---|---|---|"]
    for model in args.models.split(","):
        for m in rows:
            per_v = {v: sums[(model, m, v)] for v in VARIANTS if (model, m, v) in sums}
            full = {v: t for v, t in per_v.items() if all(
                isinstance(r["variants"].get(str(v)), float) for r in results if r["model"] == model and r["m"] == m)}
            one = min(full, key=full.get) if full else None
            b, s, e = sums[(model, m, "bf16")], sums[(model, m, "shipped")], sums[(model, m, "sk")]
            lines.append(f"| {model} | {m} | {b:.1f} | {s:.1f} | {e:.1f} | {full[one]:.1f} | {one} | {b / e:.2f}x |"
                         if one else f"| {model} | {m} | {b:.1f} | {s:.1f} | {e:.1f} | - | - | {b / e:.2f}x |")
    write_report(args.out, "fp8_streamk", lines, results)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="64,128,192,256")
    p.add_argument("--models", default="qwen3-4b")
    p.add_argument("--check", action="store_true")
    a = p.parse_args()
    check_cpu() if a.check else bench(a)
