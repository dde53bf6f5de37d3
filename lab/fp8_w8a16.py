"""FP8 weights at 64-2,048 input rows as W8A16: the weight tile widened to the input's 16-bit type in
registers (times its block's scale where scales are block-wise) and multiplied on the 16-bit tensor cores,
the sum accumulated in the MMA; per-channel scales multiply the finished sums. Against the shipped W8A8
paths it needs no quantization of the input rows and no float32 scaling of each step's product (the two
costs docs/BENCHMARKS.md names for `fp8_rows` and `fp8_block_gemm`), and it reads half of bf16's weight
bytes at bf16's MMA rate.

Timed beside bf16 `F.linear` and the shipped `fp8_linear` (per channel and 128 x 128 blocks), each checked
against the dequantized product first, us per product inside a CUDA graph over several weight copies:

    python lab/fp8_w8a16.py --out DIR [--rows 64,128,256,512,2048] [--models qwen3-4b]   DIR/fp8_w8a16.md

`engine`: the default offline workload (256 requests, 100-1,024 tokens in and out, seed 0, greedy, eos
ignored) with FP8 weights (and `--kv fp8`), output tok/s, shipped or (`--w8a16 R`) with every product of
33-R rows through `w8a16` at ENGINE_TILE, the norms and SiLU-and-mul before those products writing their
rows unquantized. One process per run, alternating:

    python lab/fp8_w8a16.py engine --bf16                     # the bf16 model, for the ratio
    for r in 0 512 0 512; do python lab/fp8_w8a16.py engine --w8a16 $r; done    # 0: shipped

On the CPU (`--check`, under the interpreter) it only checks the kernel on small shapes.
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

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fp8_mid_rows import SHAPES  # noqa: E402  (the models' products, as that sweep times them)
from tokenmill.layers.kernels import split_k  # noqa: E402

COPIES = 4
# (swap, block_m, block_n, block_k, num_warps, num_stages): swap puts the weight rows on the tensor cores'
# wide side (block_n of them) and the input rows on the narrow one, as `fp8_rows` does, and is also timed
# with K split so that the tiles fill the SMs once (`split_k`, as `fp8_rows` splits)
TILES = ((True, 32, 64, 128, 4, 4), (True, 64, 64, 128, 4, 4), (True, 64, 128, 128, 4, 3), (True, 128, 128, 64, 8, 3),
         (False, 64, 64, 128, 4, 4), (False, 64, 128, 128, 4, 4), (False, 128, 128, 64, 8, 3),
         (False, 128, 256, 64, 8, 3))


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, x_stride, w_stride, s_stride,
                  out_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  NUM_STAGES: tl.constexpr, SWAP: tl.constexpr, SPLIT: tl.constexpr, BLOCK_SCALE: tl.constexpr,
                  SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr):
    # out[m, n] = sum over k of x[m, k] * w[n, k] (* the block's scale), w widened to x's type; program p:
    # its input row block the fastest, so that the programs sharing a weight row block run together
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(M, BLOCK_M)
    n_block = pid // m_blocks
    m = (pid % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)
    m_mask, row_mask = m < M, rows < N
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    s_row = s_ptr + (n_block * BLOCK_N // SCALE_BN) * s_stride
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_begin, k_end = split_k.k_range(K, BLOCK_K, SPLIT)       # SPLIT > 1: SWAP only
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + c
        k_ok = kk < K
        if SWAP:
            w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * w_stride + kk[None, :],
                        mask=row_mask[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + m.to(tl.int64)[None, :] * x_stride + kk[:, None], mask=k_ok[:, None] & m_mask[None, :],
                        other=0.0)
        else:
            w = tl.load(w_ptr + rows.to(tl.int64)[None, :] * w_stride + kk[:, None],
                        mask=k_ok[:, None] & row_mask[None, :], other=0.0)
            x = tl.load(x_ptr + m.to(tl.int64)[:, None] * x_stride + kk[None, :], mask=m_mask[:, None] & k_ok[None, :],
                        other=0.0)
        if BLOCK_SCALE:   # a row block within one scale row, a step within one scale column
            w = (w.to(tl.float32) * tl.load(s_row + k0 // SCALE_BK)).to(dtype)
        else:
            w = w.to(dtype)
        if SWAP:
            acc = tl.dot(w, x, acc)
        else:
            acc = tl.dot(x, w, acc)
    if SWAP:
        acc, out_mask = split_k.gather(acc, row_mask[:, None] & m_mask[None, :], part_ptr, count_ptr, rows, m, N,
                                       m_blocks * BLOCK_M, SPLIT)
        if not BLOCK_SCALE:
            acc *= tl.load(s_ptr + rows * s_stride, mask=row_mask, other=0.0)[:, None]
        tl.store(out_ptr + m.to(tl.int64)[None, :] * out_stride + rows[:, None], acc.to(dtype), mask=out_mask)
    else:
        if not BLOCK_SCALE:
            acc *= tl.load(s_ptr + rows * s_stride, mask=row_mask, other=0.0)[None, :]
        tl.store(out_ptr + m.to(tl.int64)[:, None] * out_stride + rows[None, :], acc.to(dtype),
                 mask=m_mask[:, None] & row_mask[None, :])


def w8a16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], tile,
          split: int = 1) -> torch.Tensor:
    """x [M, K] (16-bit) @ (weight [N, K] FP8 * scale)^T in x's dtype; `block` (1, K) per channel."""
    swap, block_m, block_n, block_k, warps, stages = tile
    if split > 1 and not swap:
        raise ValueError("K splits only with the weight rows on the wide side")
    M, K = x.shape
    N = weight.shape[0]
    block_scale = block != (1, K)
    if block_scale and (block[0] % block_n or block[1] % block_k):
        raise ValueError(f"{tile} straddles scale blocks of {block}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    m_blocks = triton.cdiv(M, block_m)
    blocks = m_blocks * triton.cdiv(N, block_n)
    part, count = split_k.scratch(x.device, split, N, m_blocks * block_m, blocks)
    _w8a16_kernel[(blocks, split)](x, weight, scale, out, part, count, M, N, K, x.stride(0), weight.stride(0),
                                   scale.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                   NUM_STAGES=stages, SWAP=swap, SPLIT=split, BLOCK_SCALE=block_scale,
                                   SCALE_BN=block[0], SCALE_BK=block[1], num_warps=warps)
    return out


def fill_split(tile, m: int, n: int, sms: int) -> int:
    """The K split with which a swapped tile's programs fill the SMs about once."""
    swap, block_m, block_n = tile[:3]
    return max(1, -(-sms // (-(-m // block_m) * -(-n // block_n)))) if swap else 1


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().mean()).item()


def check_cpu():
    from tokenmill.quant import fp8
    torch.manual_seed(0)
    for m, n, k in ((5, 256, 256), (70, 130, 384)):
        w = torch.randn(n, k) * 0.05
        x = torch.randn(m, k).half()
        for blk in ((1, k), (128, 128)):
            q, s = fp8.quantize(w, blk if blk[0] > 1 else None)
            want = x.float() @ fp8.dequantize(q, s, blk).t()
            for tile, split in (((True, 16, 64, 128, 4, 2), 1), ((True, 16, 64, 128, 4, 2), 2),
                                ((False, 16, 64, 64, 4, 2), 1)):
                err = _error(w8a16(x, q, s, blk, tile, split), want)
                print(m, n, k, blk, tile, split, f"err {err:.4f}")
                assert err < 0.02


def bench(args):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "device"))
    from fp8_products import graph_us, write_report
    from tokenmill.layers.kernels.fp8_gemm import fp8_linear
    from tokenmill.quant import fp8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = ["| model | product | scales | M | bf16 | shipped FP8 | W8A16 best | best tile | bf16 / shipped | "
             "bf16 / W8A16 |", "|---|---|---|---|---|---|---|---|---|---|"]
    results = []
    for model in args.models.split(","):
        for name, (n, k) in SHAPES[model].items():
            ws = [torch.randn(n, k, device="cuda").mul_(0.05) for _ in range(COPIES)]
            bf = [w.bfloat16() for w in ws]
            for blk in ((1, k), (128, 128)):
                qs = [fp8.quantize(w, blk if blk[0] > 1 else None) for w in ws]
                w_ref = fp8.dequantize(*qs[0], blk).t()
                for m in [int(r) for r in args.rows.split(",")]:
                    x = torch.randn(m, k, device="cuda").bfloat16()
                    want = x.float() @ w_ref
                    bf16 = graph_us([lambda w=w: F.linear(x, w) for w in bf])
                    shipped = graph_us([lambda q=q: fp8_linear(x, *q, blk) for q in qs])
                    tiles = {}
                    for tile, split in [(t, sp) for t in TILES for sp in sorted({1, fill_split(t, m, n, sms)})]:
                        name = f"{tile} split {split}"
                        try:
                            err = _error(w8a16(x, *qs[0], blk, tile, split), want)
                        except Exception as e:      # a tile that does not fit: named, not fatal
                            tiles[name] = f"skipped {type(e).__name__}"
                            continue
                        tiles[name] = graph_us([lambda q=q, t=tile, sp=split: w8a16(x, *q, blk, t, sp) for q in qs]) \
                            if err < 0.02 else f"WRONG {err:.4f}"
                    timed = {t: v for t, v in tiles.items() if isinstance(v, float)}
                    best = min(timed, key=timed.get)
                    scales = "channel" if blk[0] == 1 else "128x128"
                    results.append(dict(model=model, product=name, scales=scales, m=m, bf16_us=bf16,
                                        shipped_us=shipped, tiles=tiles))
                    lines.append(f"| {model} | {name} | {scales} | {m} | {bf16:.2f} | {shipped:.2f} | "
                                 f"{timed[best]:.2f} | {best} | {bf16 / shipped:.2f}x | {bf16 / timed[best]:.2f}x |")
                    print(lines[-1], flush=True)
                del qs
            del ws, bf
            torch.cuda.empty_cache()
    write_report(args.out, "fp8_w8a16", lines, results)


ENGINE_TILE = ((True, 64, 64, 128, 4, 4), "fill")     # (tile, split): the split that fills the SMs once


def engine(args):
    import json

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "device"))
    from bench_fp8 import default_workload
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.kernels import fp8_gemm
    from tokenmill.models.presets import resolve_model_path
    path = resolve_model_path(args.model, "bfloat16", 0)
    if args.w8a16:
        shipped, sms = fp8_gemm.fp8_linear, torch.cuda.get_device_properties(0).multi_processor_count
        tile, split = ENGINE_TILE

        def ours(x):
            return 32 < x.shape[0] <= args.w8a16

        def routed(x, weight, scale, block, bias=None):
            if ours(x) and not isinstance(x, fp8_gemm.Fp8Rows):
                out = w8a16(x, weight, scale, block, tile,
                            fill_split(tile, x.shape[0], weight.shape[0], sms) if split == "fill" else split)
                return out if bias is None else out.add_(bias)
            return shipped(x, weight, scale, block, bias)
        fp8_gemm.fp8_linear = routed
        # the norms and SiLU-and-mul before a product of those rows write them unquantized
        from tokenmill.layers.backend import TritonBackend
        rms_norm, silu_and_mul = TritonBackend.rms_norm, TritonBackend.silu_and_mul
        TritonBackend.rms_norm = lambda self, x, weight, eps, residual=None, into=None: rms_norm(
            self, x, weight, eps, residual, None if ours(x) else into)
        TritonBackend.silu_and_mul = lambda self, x, into=None: silu_and_mul(self, x, None if ours(x) else into)
    llm = LLM(path, dtype="bfloat16", quantization=None if args.bf16 else "fp8",
              kv_cache_dtype=args.kv, seed=0)
    llm.generate([[1] * 16, [2] * 24], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    with open(os.path.join(path, "config.json")) as f:
        dt, tokens, _ = default_workload(llm, json.load(f))
    label = "bf16" if args.bf16 else f"fp8 w8a16<= {args.w8a16}" if args.w8a16 else "fp8 shipped"
    print(f"ROW {args.model} {label} kv={args.kv} {tokens / dt:.1f} output tok/s ({tokens} tokens, {dt:.2f} s)",
          flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", nargs="?", default="bench", choices=("bench", "engine"))
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="64,128,256,512,2048")
    p.add_argument("--models", default="qwen3-4b")
    p.add_argument("--check", action="store_true")
    p.add_argument("--model", default="preset:qwen3-4b", help="engine: the model")
    p.add_argument("--w8a16", type=int, default=0, help="engine: products of 33 to this many rows through w8a16")
    p.add_argument("--kv", default="auto", help="engine: --kv-cache-dtype")
    p.add_argument("--bf16", action="store_true", help="engine: the bf16 model, for the ratio")
    a = p.parse_args()
    check_cpu() if a.check else engine(a) if a.mode == "engine" else bench(a)
