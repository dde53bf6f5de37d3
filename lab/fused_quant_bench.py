"""The FP8 row quantization inside RMSNorm and SiLU-and-mul against the plain kernel followed by
`quantize_rows`, at qwen3-4b's widths (hidden 2,560, intermediate 9,728; `--inter 10496` for
nanbeige4.1-3b's), us per call inside a CUDA graph of 20 calls (PDL off), the whole-row SiLU-and-mul at 8
(shipped), 16 and 32 warps, and two ways round its one program a row (at 64 rows, 64 programs, and a
power-of-two block: 9,728 columns in 16,384 lanes):
- `split S`: S programs a row, each its share of the columns, writing y (the input dtype) and its absmax;
  the last of a row's programs to finish (a counter, as decode attention's merge) quantizes the row from
  y, which is still in L2;
- `chunked C`: one program a row, its columns in chunks of C: the absmax over one pass, then y computed
  again (gate and up from L2) and quantized.
Both give the shipped kernel's bits (`--check`).

    python lab/fused_quant_bench.py [--inter 10496]   # on the GPU; a markdown table on stdout
    TRITON_INTERPRET=1 python lab/fused_quant_bench.py --check   # each variant once on the CPU, small rows,
                                                                 # the FP8 SiLU-and-mul variants' bits checked
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from tokenmill.layers.kernels import fused_ops
from tokenmill.layers.kernels.counters import zeroed
from tokenmill.layers.kernels.fp8_quantize import quantize_rows
from tokenmill.quant.fp8 import FP8, FP8_MAX

HIDDEN = 2560
SPLITS = (2, 4, 8)
CHUNKS = (1024, 2048)


@triton.jit
def _silu_y(x_ptr, c, mask, I):
    # the shipped kernel's y for columns c of the row at x_ptr, in the input dtype
    gate = tl.load(x_ptr + c, mask=mask, other=0.0)
    up = tl.load(x_ptr + I + c, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_fp8_split_kernel(x_ptr, out_ptr, s_ptr, y_ptr, amax_ptr, counter_ptr, x_stride_t, I: tl.constexpr,
                           SPLITS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, FP8_MAX: tl.constexpr):
    # program (j, t), j fastest: columns j * BLOCK ... of row t
    j = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    c = j * BLOCK + tl.arange(0, BLOCK)
    mask = c < I
    y = _silu_y(x_ptr + t * x_stride_t, c, mask, I)
    tl.store(y_ptr + t * I + c, y, mask=mask)
    tl.store(amax_ptr + t * SPLITS + j, tl.max(tl.abs(y.to(tl.float32)), 0))
    done = tl.atomic_add(counter_ptr + t, 1, sem="acq_rel", scope="gpu")
    if done == SPLITS - 1:
        amax = tl.max(tl.load(amax_ptr + t * SPLITS + tl.arange(0, SPLITS)), 0)
        scale = tl.maximum(amax, 1e-12) / FP8_MAX
        for c0 in range(0, I, CHUNK):
            cc = c0 + tl.arange(0, CHUNK)
            m = cc < I
            v = tl.load(y_ptr + t * I + cc, mask=m, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * I + cc, tl.clamp(v / scale, -FP8_MAX, FP8_MAX).to(tl.float8e4nv), mask=m)
        tl.store(s_ptr + t, scale)
        tl.store(counter_ptr + t, 0)


@triton.jit
def _silu_fp8_chunked_kernel(x_ptr, out_ptr, s_ptr, x_stride_t, I: tl.constexpr, CHUNK: tl.constexpr,
                             FP8_MAX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([CHUNK], tl.float32)
    for c0 in range(0, I, CHUNK):
        c = c0 + tl.arange(0, CHUNK)
        amax = tl.maximum(amax, tl.abs(_silu_y(x_ptr + t * x_stride_t, c, c < I, I).to(tl.float32)))
    scale = tl.maximum(tl.max(amax, 0), 1e-12) / FP8_MAX
    for c0 in range(0, I, CHUNK):
        c = c0 + tl.arange(0, CHUNK)
        y = _silu_y(x_ptr + t * x_stride_t, c, c < I, I).to(tl.float32)
        tl.store(out_ptr + t * I + c, tl.clamp(y / scale, -FP8_MAX, FP8_MAX).to(tl.float8e4nv), mask=c < I)
    tl.store(s_ptr + t, scale)


def silu_fp8_split(x: torch.Tensor, splits: int, warps: int = 4):
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    y = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    amax = torch.empty(rows, splits, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(triton.cdiv(inter, splits))
    _silu_fp8_split_kernel[(splits, rows)](x, out, scale, y, amax, zeroed(x.device, rows), x.stride(0), I=inter,
                                           SPLITS=splits, BLOCK=block, CHUNK=2048, FP8_MAX=FP8_MAX,
                                           num_warps=warps)
    return out, scale


def silu_fp8_chunked(x: torch.Tensor, chunk: int, warps: int = 8):
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _silu_fp8_chunked_kernel[(rows,)](x, out, scale, x.stride(0), I=inter, CHUNK=chunk, FP8_MAX=FP8_MAX,
                                      num_warps=warps)
    return out, scale


def silu_fp8_warps(x: torch.Tensor, warps: int):
    """The whole-row FP8 SiLU-and-mul at `warps` warps (the shipped launch but for the warp count)."""
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(inter)
    fused_ops._act_and_mul_kernel[(x.shape[0], 1)](x, out, scale, x.stride(0), scale.stride(0), I=inter, BLOCK=block,
                                                   FP8_GROUP=block, PDL=False, ACT=1, num_warps=warps)
    return out, scale


def variants(rows: int, device: str, dtype: torch.dtype, inter: int = 9728):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, HIDDEN, device=device, generator=g).to(dtype)
    res = torch.randn(rows, HIDDEN, device=device, generator=g).to(dtype)
    w = torch.randn(HIDDEN, device=device, generator=g).to(dtype)
    gu = torch.randn(rows, 2 * inter, device=device, generator=g).to(dtype)
    return {
        "rms_norm + quantize_rows": lambda: quantize_rows(fused_ops.rms_norm(x, w, 1e-6, res)[0]),
        "rms_norm, FP8 out": lambda: fused_ops.rms_norm(x, w, 1e-6, res, fp8_group=HIDDEN),
        "silu_and_mul + quantize_rows": lambda: quantize_rows(fused_ops.act_and_mul(gu)),
        "silu_and_mul, FP8 out (shipped)": lambda: fused_ops.act_and_mul(gu, fp8_group=inter),
        "silu_and_mul, FP8 out, 16 warps": lambda: silu_fp8_warps(gu, 16),
        "silu_and_mul, FP8 out, 32 warps": lambda: silu_fp8_warps(gu, 32),
        **{f"silu_and_mul, FP8 out, split {n}": lambda n=n: silu_fp8_split(gu, n) for n in SPLITS},
        **{f"silu_and_mul, FP8 out, chunked {n}": lambda n=n: silu_fp8_chunked(gu, n) for n in CHUNKS},
        "silu_and_mul alone": lambda: fused_ops.act_and_mul(gu),
        "rms_norm alone": lambda: fused_ops.rms_norm(x, w, 1e-6, res),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="run each variant once (CPU, interpreter)")
    p.add_argument("--rows", default="16,64,154,256,512,2048")
    p.add_argument("--inter", type=int, default=9728, help="the intermediate width (nanbeige4.1-3b: 10496)")
    args = p.parse_args()
    if args.check:
        for inter in (300, 96, 4500):       # 4,500: several chunks in both variants' loops
            runs = {name: fn() for name, fn in variants(3, "cpu", torch.float32, inter).items()}
            want = runs["silu_and_mul, FP8 out (shipped)"]
            for name, got in runs.items():
                if name.startswith("silu_and_mul, FP8 out,"):
                    q, s = (got.q, got.scale) if hasattr(got, "q") else got
                    assert torch.equal(q.view(torch.uint8), want.q.view(torch.uint8)), name
                    assert torch.equal(s.view(-1), want.scale.view(-1)), name
                print(f"ran {name} ({inter} columns)")
        return
    rows = [int(r) for r in args.rows.split(",")]
    table = {}
    for m in rows:
        for name, fn in variants(m, "cuda", torch.bfloat16, args.inter).items():
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    fn()
            table.setdefault(name, {})[m] = triton.testing.do_bench(graph.replay, warmup=25, rep=200) * 1000 / 20
    print(f"| variant | {' | '.join(f'{m} rows' for m in rows)} |")
    print(f"|---|{'---|' * len(rows)}")
    for name, times in table.items():
        print(f"| {name} | {' | '.join(f'{times[m]:.2f}' for m in rows)} |")


if __name__ == "__main__":
    main()
