"""Single-token linear layers: one kernel per product of a one-row input with a weight matrix, with the
RMSNorm (+ residual add) before it and the gated activation (SiLU- or GELU-and-mul) after it folded in.

A batch-1 decode step reads every weight once and does little else, so it is bound by how close each
product gets to HBM bandwidth. The weight matrices of a 3-4B model are 20-100 MB, small enough that a
library GEMM spends a good part of its time ramping up and draining; here each layer's four products
are the only kernels that read weights, the norms and the activation ride along (two kernels fewer per
layer), and with programmatic dependent launch (`pdl.py`) a product starts fetching its weights while
the kernel before it finishes.

The first product of a step can also gather its input row from the embedding table (`ids`): the step
then starts with that product, where it started with an embedding kernel.

FP8 weights (`layers/fp8_linear.Fp8Linear`, float8_e4m3fn with float32 block scales) run the whole-row
kernel with half the weight bytes, read as int32 words of four weights. Widened to float32 for an FMA each,
they cost more instructions per byte than the 16-bit kernels spend, enough to leave the product at the
16-bit one's time; instead a pair of words meets the input as float16 pairs (see "FP8 weights" below):
about 2.6 instructions per weight in the sm90 loop against 6.6 widened (docs/BENCHMARKS.md). A row's
sum is multiplied by its scale (per output channel), or each eight columns' sum by their block's. Their
tile is the shape's measured FP8 tile (`KernelConfig.fp8_tiles`), else `fp8_tile` of its 16-bit tile.

`fused_linear` is the one entry point; `fused_linear_torch` is its reference. Which kernel and tile a
product runs is `KernelConfig.tile` (`layers/kernel_config.py`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.layers.activation import act_and_mul_torch, check_activation
from tokenmill.layers.kernel_config import KernelConfig, RegisterTile, SmemTile, Tile, WholeRowTile
from tokenmill.layers.kernels import gemv_smem, pdl
from tokenmill.layers.kernels.fused_ops import gate_act
from tokenmill.layers.norm import rms_norm_torch

MAX_ROWS = 1
FP8 = torch.float8_e4m3fn
# the kernels' SCALE: 16-bit or float32 weights as they are, FP8 with a scale per output row, FP8 with
# a scale per (block_n, block_k) block
NO_SCALE, ROW_SCALE, BLOCK_SCALE = 0, 1, 2

WHOLE_MAX = 32 * 1024   # weights in a whole-row tile's row block: its registers
# the tile of FP8 products whose 16-bit tile is not whole rows
FP8_TILE = WholeRowTile(block_n=2, num_warps=4, programs_per_sm=4)
SHIPPED = KernelConfig()

def fused_linear_torch(x, weight, bias=None, *, norm_weight=None, eps=0.0, residual=None, act=None,
                       ids=None):
    """Reference: y = linear(rms_norm(x + residual) * norm_weight) (each step optional), then
    act(gate) * up over the packed [gate | up] output when an activation `act` is named. Returns (y, x + residual), the
    second being x itself without a residual and None without a norm. `ids`: the input is x[ids]."""
    if ids is not None:
        x = F.embedding(ids, x)
    res_out = None
    if norm_weight is not None:
        res_out = x
        x, summed = rms_norm_torch(x, norm_weight, eps, residual)
        if residual is not None:
            res_out = summed
    y = F.linear(x, weight, bias)
    return (y if act is None else act_and_mul_torch(y, act)), res_out


@triton.jit
def _normed(h, nw_ptr, rstd, kk, K: tl.constexpr, NORM: tl.constexpr, dtype: tl.constexpr):
    # input columns kk, loaded (and summed with the residual) as h, in float32, normalised with the
    # rounding of rms_norm_torch: times rstd, then times the norm weight, each rounded to dtype
    if NORM:
        h = (h * rstd).to(dtype).to(tl.float32)
        h = (h * tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    return h


@triton.jit
def _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, k0, c, K: tl.constexpr,
                 NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    # columns k0 + c of the product's input, rounded as rms_norm_torch rounds them, in float32
    kk = k0 + c
    mask = kk < K
    h = tl.load(x_ptr + kk, mask=mask, other=0.0)
    dtype: tl.constexpr = h.dtype
    if RESIDUAL:
        h = (h.to(tl.float32) + tl.load(res_ptr + kk, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    return _normed(h.to(tl.float32), nw_ptr, rstd, kk, K, NORM, dtype)


@triton.jit
def _row_scaled(y, s_ptr, s_stride, rows, row_mask, SCALE: tl.constexpr):
    # a row's sum times its output channel's scale (per-channel FP8); y itself for other weights
    if SCALE == 1:
        y *= tl.load(s_ptr + rows * s_stride, mask=row_mask, other=0.0)
    return y


@triton.jit
def _whole_loads(ptrs, mask):
    # weights of a whole-row block, read once a step: past L1 (.cg)
    return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, ids_ptr, eps, n_out, w_stride,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                 RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GATHER: tl.constexpr,
                 PDL: tl.constexpr):
    # Persistent: program p computes row blocks p, p + P, ... of the output. With an activation (ACT, as
    # `fused_ops.gate_act` takes it; 0: none) the weight is [gate | up] stacked by rows, and output row n
    # needs weight rows n and n_out + n, which give act(gate) * up. With GATHER the
    # input is row ids[0] of the table at x_ptr, which program 0 also writes to res_out (NORM only).
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_units = tl.cdiv(n_out, BLOCK_N)
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)

    # weights never change: the first tile is requested before waiting for the previous kernel
    rows = pid * BLOCK_N + r
    tile_mask = (rows < n_out)[:, None] & (c < K)[None, :]
    w_first = tl.load(w_ptr + rows.to(tl.int64)[:, None] * w_stride + c[None, :], mask=tile_mask, other=0.0)
    u_first = w_first
    if ACT != 0:
        u_first = tl.load(w_ptr + (rows + n_out).to(tl.int64)[:, None] * w_stride + c[None, :], mask=tile_mask,
                          other=0.0)
    pdl.enter(PDL)
    if GATHER:   # the id may come from the kernel before (placeholders filled on the device): after the wait
        x_ptr += tl.load(ids_ptr).to(tl.int64) * K

    rstd = 1.0
    if NORM:
        sq = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            h = _input_chunk(x_ptr, res_ptr, nw_ptr, 1.0, k0, c, K, False, RESIDUAL)
            sq += h * h
            if RESIDUAL or GATHER:
                if pid == 0:
                    tl.store(res_out_ptr + k0 + c, h.to(res_out_ptr.dtype.element_ty), mask=k0 + c < K)
        rstd = tl.rsqrt(tl.sum(sq, 0) / K + eps)

    for unit in range(pid, num_units, num_programs):
        rows = unit * BLOCK_N + r
        row_mask = rows < n_out
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_stride
        u_rows = w_rows + n_out * w_stride
        if unit == pid:
            w = w_first
            u = u_first
        else:
            tile_mask = row_mask[:, None] & (c < K)[None, :]
            w = tl.load(w_rows + c[None, :], mask=tile_mask, other=0.0)
            u = w
            if ACT != 0:
                u = tl.load(u_rows + c[None, :], mask=tile_mask, other=0.0)
        xk = _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 0, c, K, NORM, RESIDUAL)
        # per element, summed per row once the row is done
        acc = w.to(tl.float32) * xk[None, :]
        acc_u = acc
        if ACT != 0:
            acc_u = u.to(tl.float32) * xk[None, :]
        # one chunk in flight per program (num_stages=1): the registers hold the next chunk, not a pipeline
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=1):
            tile_mask = row_mask[:, None] & (k0 + c < K)[None, :]
            xk = _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, k0, c, K, NORM, RESIDUAL)
            acc += tl.load(w_rows + k0 + c[None, :], mask=tile_mask, other=0.0).to(tl.float32) * xk[None, :]
            if ACT != 0:
                acc_u += tl.load(u_rows + k0 + c[None, :], mask=tile_mask, other=0.0).to(tl.float32) * xk[None, :]
        y = tl.sum(acc, 1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        if ACT != 0:
            g = y.to(out_ptr.dtype.element_ty).to(tl.float32)
            up = tl.sum(acc_u, 1).to(out_ptr.dtype.element_ty).to(tl.float32)
            y = gate_act(g, ACT).to(out_ptr.dtype.element_ty).to(tl.float32) * up
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _whole_rows(w_ptr, w_stride, unit, num_units, n_out, first_row, r, ca, cb, K: tl.constexpr,
                BLOCK_N: tl.constexpr, TWO: tl.constexpr, PACKED: tl.constexpr):
    # every weight of row block `unit` (none past the last unit), in one or two loads issued together;
    # weight rows from first_row on (n_out: the up rows of the gated activation). PACKED (FP8): w_ptr holds int32
    # words of four FP8 weights, ca / cb index pairs of words (eight columns), and a load is [rows, pairs, 2]
    rows = unit * BLOCK_N + r
    ok = (rows < n_out) & (unit < num_units)
    base = w_ptr + (rows + first_row).to(tl.int64)[:, None] * w_stride
    if PACKED:
        two = tl.arange(0, 2)
        wa = _whole_loads(base[:, :, None] + (2 * ca[None, :, None] + two[None, None, :]),
                          ok[:, None, None] & (8 * ca < K)[None, :, None])
        wb = wa
        if TWO:
            wb = _whole_loads(base[:, :, None] + (2 * cb[None, :, None] + two[None, None, :]),
                              ok[:, None, None] & (8 * cb < K)[None, :, None])
    else:
        wa = _whole_loads(base + ca[None, :], ok[:, None] & (ca < K)[None, :])
        wb = wa
        if TWO:
            wb = _whole_loads(base + cb[None, :], ok[:, None] & (cb < K)[None, :])
    return wa, wb


@triton.jit
def _whole_block(w_ptr, w_stride, unit, num_units, n_out, r, ca, cb, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 TWO: tl.constexpr, ACT: tl.constexpr, PACKED: tl.constexpr):
    # `_whole_rows` of row block `unit`, and with an activation of its up rows too (the same as the gate's
    # without)
    wa, wb = _whole_rows(w_ptr, w_stride, unit, num_units, n_out, 0, r, ca, cb, K, BLOCK_N, TWO, PACKED)
    ua, ub = wa, wb
    if ACT != 0:
        ua, ub = _whole_rows(w_ptr, w_stride, unit, num_units, n_out, n_out, r, ca, cb, K, BLOCK_N, TWO, PACKED)
    return wa, wb, ua, ub


@triton.jit
def _whole_sums(wa, wb, xa, xb, TWO: tl.constexpr):
    # one float per row: a row block's whole rows times the input
    y = tl.sum(wa.to(tl.float32) * xa[None, :], 1)
    if TWO:
        y += tl.sum(wb.to(tl.float32) * xb[None, :], 1)
    return y


# ---- FP8 weights: products in float16 pairs --------------------------------------------------------------
# Widening each FP8 weight to float32 for an FMA costs more instructions than the weight's byte is worth.
# Instead each program scales its input by a power of two so that |x| < 16, rounds it to float16 pairs, and
# a step of eight weights is two `cvt.f16x2.e4m3x2` per word and four `fma.f16x2`: each half of the pair
# sums four products of at most 448 * 16, below float16's 65504. The eight-weight sums are added in float32.
# Triton's interpreter runs no PTX: on CPU tensors the same arithmetic is emulated (ASM off).

@triton.jit
def _f16_pairs(lo, hi, ASM: tl.constexpr):
    # float32 vectors lo, hi as one int32 vector of float16 pairs, lo in the low half
    if ASM:
        pairs = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                          is_pure=True, pack=1)
    else:
        pairs = (lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | \
            (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)
    return pairs


@triton.jit
def _fp8_byte(word, i: tl.constexpr):
    # FP8 weight i of each int32 word, as float32 (emulation)
    return ((word >> (8 * i)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _f16_half(pairs, i: tl.constexpr):
    # half i of each float16 pair, as float32 (emulation)
    return ((pairs >> (16 * i)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp8_dot8(w, x0, x1, x2, x3, ASM: tl.constexpr):
    # w [rows, pairs, 2] words of FP8 weights times the input's float16 pairs x0..x3 [pairs] (columns
    # 8p + 0/1, 2/3, 4/5, 6/7): [rows, pairs] float32 sums of eight products
    lo, hi = tl.split(w)
    x0, x1, x2, x3 = x0[None, :], x1[None, :], x2[None, :], x3[None, :]
    if ASM:
        y = tl.inline_asm_elementwise(
            """{ .reg .b16 l, h; .reg .b32 a, b, p; .reg .f16 pl, ph; .reg .f32 fl, fh;
            mov.b32 {l, h}, $1;
            cvt.rn.f16x2.e4m3x2 a, l;
            cvt.rn.f16x2.e4m3x2 b, h;
            mul.rn.f16x2 p, a, $3;
            fma.rn.f16x2 p, b, $4, p;
            mov.b32 {l, h}, $2;
            cvt.rn.f16x2.e4m3x2 a, l;
            cvt.rn.f16x2.e4m3x2 b, h;
            fma.rn.f16x2 p, a, $5, p;
            fma.rn.f16x2 p, b, $6, p;
            mov.b32 {pl, ph}, p;
            cvt.f32.f16 fl, pl;
            cvt.f32.f16 fh, ph;
            add.f32 $0, fl, fh; }""",
            "=f,r,r,r,r,r,r", [lo, hi, x0, x1, x2, x3], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = _fp8_byte(lo, 0) * _f16_half(x0, 0) + _fp8_byte(lo, 1) * _f16_half(x0, 1) + \
            _fp8_byte(lo, 2) * _f16_half(x1, 0) + _fp8_byte(lo, 3) * _f16_half(x1, 1) + \
            _fp8_byte(hi, 0) * _f16_half(x2, 0) + _fp8_byte(hi, 1) * _f16_half(x2, 1) + \
            _fp8_byte(hi, 2) * _f16_half(x3, 0) + _fp8_byte(hi, 3) * _f16_half(x3, 1)
    return y


@triton.jit
def _input_pairs(x_ptr, res_ptr, nw_ptr, rstd, xs, p, K: tl.constexpr, NORM: tl.constexpr,
                 RESIDUAL: tl.constexpr, ASM: tl.constexpr):
    # the input's columns 8p .. 8p + 7 as `_input_chunk` gives them, times xs, as four float16-pair vectors
    x0 = _f16_pairs(_input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 0, 8 * p, K, NORM, RESIDUAL) * xs,
                    _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 1, 8 * p, K, NORM, RESIDUAL) * xs, ASM)
    x1 = _f16_pairs(_input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 2, 8 * p, K, NORM, RESIDUAL) * xs,
                    _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 3, 8 * p, K, NORM, RESIDUAL) * xs, ASM)
    x2 = _f16_pairs(_input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 4, 8 * p, K, NORM, RESIDUAL) * xs,
                    _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 5, 8 * p, K, NORM, RESIDUAL) * xs, ASM)
    x3 = _f16_pairs(_input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 6, 8 * p, K, NORM, RESIDUAL) * xs,
                    _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 7, 8 * p, K, NORM, RESIDUAL) * xs, ASM)
    return x0, x1, x2, x3


@triton.jit
def _pow2(e):
    # 2 ** e for an int32 e in [-126, 127], exactly
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_sums(w, x0, x1, x2, x3, s_ptr, s_stride, first_row, p, K: tl.constexpr, SCALE: tl.constexpr,
              SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, ASM: tl.constexpr):
    # one float per row of w's pairs of words times the input pairs; with block scales each eight-column
    # sum times its block's scale (a row block within one scale row, eight columns within one block)
    y = _fp8_dot8(w, x0, x1, x2, x3, ASM)
    if SCALE == 2:
        y *= tl.load(s_ptr + (first_row // SCALE_BN) * s_stride + (8 * p) // SCALE_BK, mask=8 * p < K,
                     other=0.0)[None, :]
    return tl.sum(y, 1)


@triton.jit
def _gemv_whole_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, ids_ptr, s_ptr, eps, n_out,
                       w_stride, s_stride, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_K2: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                       ACT: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr, SCALE: tl.constexpr,
                       SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, ASM: tl.constexpr):
    # `_gemv_kernel` with whole rows: a row block's K columns are one load of BLOCK_K (a power of two)
    # and, when K is longer, one of BLOCK_K2 more, both in flight at once, so a row block costs one
    # round trip to HBM; the first is requested before the wait, and the next row block's loads are
    # issued before this one is summed. The input is loaded (and normalised) once per program. With an
    # activation (ACT) the up rows (n_out further on) come with the gate rows. FP8 weights (SCALE > 0) come as int32
    # words (w_ptr, w_stride in words) and multiply as float16 pairs (above).
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_units = tl.cdiv(n_out, BLOCK_N)
    TWO: tl.constexpr = K > BLOCK_K
    PACKED: tl.constexpr = SCALE > 0
    r = tl.arange(0, BLOCK_N)
    ca = tl.arange(0, BLOCK_K)
    cb = BLOCK_K + tl.arange(0, BLOCK_K2)
    if PACKED:      # the weights' columns as pairs of words, eight columns each
        wca = tl.arange(0, BLOCK_K // 8)
        wcb = BLOCK_K // 8 + tl.arange(0, BLOCK_K2 // 8)
    else:
        wca, wcb = ca, cb
    wa, wb, ua, ub = _whole_block(w_ptr, w_stride, pid, num_units, n_out, r, wca, wcb, K, BLOCK_N, TWO, ACT,
                                  PACKED)
    pdl.enter(PDL)
    if GATHER:
        x_ptr += tl.load(ids_ptr).to(tl.int64) * K
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    ha = _input_chunk(x_ptr, res_ptr, nw_ptr, 1.0, 0, ca, K, False, RESIDUAL)
    hb = ha
    if TWO:
        hb = _input_chunk(x_ptr, res_ptr, nw_ptr, 1.0, 0, cb, K, False, RESIDUAL)
    rstd = 1.0
    if NORM:
        sq = tl.sum(ha * ha, 0)
        if TWO:
            sq += tl.sum(hb * hb, 0)
        if RESIDUAL or GATHER:
            if pid == 0:
                tl.store(res_out_ptr + ca, ha.to(dtype), mask=ca < K)
                if TWO:
                    tl.store(res_out_ptr + cb, hb.to(dtype), mask=cb < K)
        rstd = tl.rsqrt(sq / K + eps)
    xa = _normed(ha, nw_ptr, rstd, ca, K, NORM, dtype)
    xb = xa
    if TWO:
        xb = _normed(hb, nw_ptr, rstd, cb, K, NORM, dtype)
    if PACKED:
        # x times 2 ** (130 - E), E the biased exponent of its largest |x|, lies below 16 in magnitude
        amax = tl.max(tl.abs(xa), 0)
        if TWO:
            amax = tl.maximum(amax, tl.max(tl.abs(xb), 0))
        e = tl.minimum(tl.maximum(130 - ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF), -126), 126)
        xs = _pow2(e)
        x_unscale = _pow2(-e)
        xa0, xa1, xa2, xa3 = _input_pairs(x_ptr, res_ptr, nw_ptr, rstd, xs, wca, K, NORM, RESIDUAL, ASM)
        xb0, xb1, xb2, xb3 = xa0, xa1, xa2, xa3
        if TWO:
            xb0, xb1, xb2, xb3 = _input_pairs(x_ptr, res_ptr, nw_ptr, rstd, xs, wcb, K, NORM, RESIDUAL, ASM)

    for unit in range(pid, num_units, num_programs):
        na, nb, nua, nub = _whole_block(w_ptr, w_stride, unit + num_programs, num_units, n_out, r, wca, wcb, K,
                                        BLOCK_N, TWO, ACT, PACKED)
        rows = unit * BLOCK_N + r
        row_mask = rows < n_out
        if PACKED:
            y = _fp8_sums(wa, xa0, xa1, xa2, xa3, s_ptr, s_stride, unit * BLOCK_N, wca, K, SCALE, SCALE_BN,
                          SCALE_BK, ASM)
            if TWO:
                y += _fp8_sums(wb, xb0, xb1, xb2, xb3, s_ptr, s_stride, unit * BLOCK_N, wcb, K, SCALE, SCALE_BN,
                               SCALE_BK, ASM)
            y = _row_scaled(y * x_unscale, s_ptr, s_stride, rows, row_mask, SCALE)
        else:
            y = _whole_sums(wa, wb, xa, xb, TWO)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        if ACT != 0:
            g = y.to(dtype).to(tl.float32)
            if PACKED:
                up = _fp8_sums(ua, xa0, xa1, xa2, xa3, s_ptr, s_stride, n_out + unit * BLOCK_N, wca, K, SCALE,
                               SCALE_BN, SCALE_BK, ASM)
                if TWO:
                    up += _fp8_sums(ub, xb0, xb1, xb2, xb3, s_ptr, s_stride, n_out + unit * BLOCK_N, wcb, K, SCALE,
                                    SCALE_BN, SCALE_BK, ASM)
                up = _row_scaled(up * x_unscale, s_ptr, s_stride, rows + n_out, row_mask, SCALE)
            else:
                up = _whole_sums(ua, ub, xa, xb, TWO)
            up = up.to(dtype).to(tl.float32)
            y = gate_act(g, ACT).to(dtype).to(tl.float32) * up
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)
        wa, wb, ua, ub = na, nb, nua, nub


def _pointers(x, weight, bias, norm_weight, residual, ids, out, res_out, scale, m):
    # row m's tensors for the kernels' pointer arguments (x_ptr .. s_ptr); an absent one stands in as
    # a tensor of the call that the kernel does not read
    return (x if ids is not None else x[m], residual[m] if residual is not None else x,
            norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight,
            out[m], res_out[m] if residual is not None or ids is not None else out[m],
            ids[m:] if ids is not None else out[m], scale if scale is not None else weight)


def fp8_tile(tile: Tile) -> WholeRowTile:
    """The tile of an FP8 product whose 16-bit tile is `tile`. FP8 products run whole rows (a register holds
    four weights): twice the rows of a 16-bit whole-row block (as many bytes in flight), else FP8_TILE."""
    if isinstance(tile, WholeRowTile):
        return dataclasses.replace(tile, block_n=2 * tile.block_n)
    return FP8_TILE


def fp8_tile_of(kernels: KernelConfig, n: int, k: int, gated: bool) -> Tile:
    """The tile an FP8 product of weight [n, k] (a gated activation after it when `gated`) runs unless given
    one: its shape's `kernels.fp8_tiles` entry, else `fp8_tile` of its 16-bit tile."""
    return kernels.fp8_tile(n, k, gated) or fp8_tile(kernels.tile(n, k, gated))


def _scale_mode(weight, weight_scale, weight_block, x_dtype) -> tuple[int, tuple[int, int]]:
    # (SCALE, the kernels' (SCALE_BN, SCALE_BK): (1, 1) unless BLOCK_SCALE), or an error naming the misfit
    n, k = weight.shape
    if weight.dtype != FP8:
        if weight_scale is not None or x_dtype != weight.dtype or x_dtype not in (torch.float16, torch.bfloat16,
                                                                                   torch.float32):
            raise TypeError(f"fused_linear: x {x_dtype} and weight {weight.dtype} must be one float dtype "
                            f"(or an FP8 weight with its scale)")
        return NO_SCALE, (1, 1)
    if x_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"fused_linear: an FP8 weight needs a float input, got {x_dtype}")
    if weight_scale is None or weight_block is None:
        raise ValueError("fused_linear: an FP8 weight needs its weight_scale and weight_block")
    bn, bk = weight_block
    if (weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (-(-n // bn), -(-k // bk))
            or weight_scale.stride(1) != 1):
        raise ValueError(f"fused_linear: weight_scale {weight_scale.dtype} {tuple(weight_scale.shape)} does not "
                         f"fit weight {tuple(weight.shape)} with block {tuple(weight_block)}")
    return (ROW_SCALE, (1, 1)) if (bn, bk) == (1, k) else (BLOCK_SCALE, (bn, bk))


def _block_scale_problem(scale_mode: int, n_out: int, gated: bool, block_n: int, scale_bn: int) -> str | None:
    # with block scales, a row block (gate and up rows alike) must lie within one row of scales
    if scale_mode == BLOCK_SCALE and (scale_bn % block_n or (gated and n_out % block_n)):
        return (f"a row block of {block_n} rows straddles scale blocks of {scale_bn} rows"
                f"{f' (or the up rows from {n_out} on)' if gated else ''}")
    return None


def _num_sms(device: torch.device) -> int:
    from tokenmill.layers.kernels.attention_common import num_sms
    return num_sms(device.index or 0) if device.type == "cuda" else 4


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                 residual: torch.Tensor | None = None, act: str | None = None,
                 tile: Tile | None = None, kernels: KernelConfig = SHIPPED, ids: torch.Tensor | None = None,
                 weight_scale: torch.Tensor | None = None, weight_block: tuple[int, int] | None = None):
    """`fused_linear_torch` for x [M, K] with M <= MAX_ROWS, in one kernel per row. Returns
    (y, residual_out): y is [M, N] ([M, N / 2] with an activation `act`, of `activation.ACTIVATIONS`: the weight
    is [gate | up], y act(gate) * up); residual_out is x + residual when both a norm and a residual are given, x
    when only the norm is, else None.

    The kernel runs `tile`, which must suit the product, or else `kernels.tile(N, K, act is not None)`, which
    falls
    back to `kernels.default_tile` where it does not (a shared-memory tile for a float32 product).

    An FP8 weight (float8_e4m3fn) comes with `weight_scale` (float32 [ceil(N / bn), ceil(K / bk)]) and
    `weight_block` (bn, bk): W = weight * weight_scale of its block, (1, K) being per output channel. It
    runs a whole-row tile: the shape's in `kernels.fp8_tiles`, else `fp8_tile` of its 16-bit tile (an
    explicit `tile` runs as given). Its products take the input in float16 (above); a K or a block of
    columns that is not a multiple of 8 has its weight dequantized for the call instead.

    `ids` (int64 [M], with a norm and no residual): x is an embedding table [V, K] and the input rows are
    x[ids], gathered by the kernel, which also returns them as residual_out."""
    if ids is not None:
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.shape[0] > MAX_ROWS or ids.device != x.device:
            raise ValueError(f"fused_linear: ids must be int64 [M <= {MAX_ROWS}] on x's device, got {ids.dtype} "
                             f"{tuple(ids.shape)} on {ids.device}")
        if norm_weight is None or residual is not None or not x.is_contiguous():
            raise ValueError("fused_linear: gathered input rows (ids) need a norm, no residual and a "
                             "contiguous table")
    if x.dim() != 2 or (ids is None and x.shape[0] > MAX_ROWS):
        raise ValueError(f"fused_linear: x must be [M, K] with M <= {MAX_ROWS}, got {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"fused_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must share "
                         f"K and have unit last strides")
    scale_mode, (scale_bn, scale_bk) = _scale_mode(weight, weight_scale, weight_block, x.dtype)
    gated = act is not None
    code = check_activation(act) if gated else 0
    if gated and (n % 2 or bias is not None):
        raise ValueError(f"fused_linear: an activation ({act}) needs an even number of weight rows (got {n}) and no "
                         "bias")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"fused_linear: bias must be [{n}], got {tuple(bias.shape)}")
    if residual is not None and (norm_weight is None or residual.shape != x.shape
                                 or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"fused_linear: a residual {tuple(residual.shape)} needs a norm and must match "
                         f"x {tuple(x.shape)} {x.dtype}")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.stride(0) != 1):
        raise ValueError(f"fused_linear: norm_weight must be [{k}], got {tuple(norm_weight.shape)}")
    explicit = tile is not None
    n_out = n // 2 if gated else n
    one_row = dataclasses.replace(FP8_TILE, block_n=1)     # one row never straddles scale blocks
    if scale_mode != NO_SCALE and (k % 8 or (scale_mode == BLOCK_SCALE and scale_bk % 8) or weight.stride(0) % 4
                                   or _whole_tile_problem(k, gated, one_row, FP8)):
        from tokenmill.quant.fp8 import dequantize
        return fused_linear(x, dequantize(weight, weight_scale, weight_block).to(x.dtype), bias,
                            norm_weight=norm_weight, eps=eps, residual=residual, act=act, kernels=kernels, ids=ids)
    if scale_mode != NO_SCALE:
        if not explicit:
            tile = fp8_tile_of(kernels, n, k, gated)
        why = ("FP8 weights run whole-row tiles" if not isinstance(tile, WholeRowTile) else
               _whole_tile_problem(k, gated, tile, FP8) or _block_scale_problem(scale_mode, n_out, gated,
                                                                                tile.block_n, scale_bn))
        if why is not None:
            if explicit:
                raise ValueError(f"fused_linear: {tile} for weight {tuple(weight.shape)}: {why}")
            tile = one_row
    else:
        tile = tile if explicit else kernels.tile(n, k, gated)
    if isinstance(tile, SmemTile) and ids is not None:   # that kernel reads its input as given: gather first
        return fused_linear(F.embedding(ids, x), weight, bias, norm_weight=norm_weight, eps=eps, act=act,
                            tile=tile if explicit else None, kernels=kernels)
    rows = x.shape[0] if ids is None else ids.shape[0]
    out = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    res_out = None
    if norm_weight is not None:
        res_out = torch.empty_like(x) if residual is not None else x
        if ids is not None:
            res_out = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    pdl_on = pdl.enabled(x.device)
    why = None
    if isinstance(tile, SmemTile):
        why = gemv_smem.check_tile(n, k, gated, x.dtype, tile)
        if why is None:
            for m in range(x.shape[0]):
                gemv_smem.smem_linear(x[m], weight, bias, norm_weight, eps,
                                      residual[m] if residual is not None else None, code, out[m],
                                      res_out[m] if residual is not None else None, tile, pdl_on)
            return out, res_out
    elif isinstance(tile, WholeRowTile):
        why = _whole_tile_problem(k, gated, tile, weight.dtype)
        if why is None:
            return _whole_linear(x, weight, bias, norm_weight, eps, residual, code, ids, tile, out, res_out,
                                 pdl_on, weight_scale, scale_mode, scale_bn, scale_bk)
    elif not isinstance(tile, RegisterTile):
        raise TypeError(f"fused_linear: {tile!r} is not a tile")
    if why is not None:
        if explicit:
            raise ValueError(f"fused_linear: {tile} for weight {tuple(weight.shape)}: {why}")
        tile = kernels.default_tile
    block_n, block_k = tile.block_n, min(tile.block_k, triton.next_power_of_2(k))
    grid = (min(triton.cdiv(n_out, block_n), tile.programs_per_sm * _num_sms(x.device)),)
    for m in range(rows):
        _gemv_kernel[grid](
            *_pointers(x, weight, bias, norm_weight, residual, ids, out, res_out, None, m)[:8], eps, n_out,
            weight.stride(0), K=k, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None,
            RESIDUAL=residual is not None, HAS_BIAS=bias is not None, ACT=code, GATHER=ids is not None,
            PDL=pdl_on, num_warps=tile.num_warps, launch_pdl=pdl_on)
    return out, res_out


def _whole_blocks(k: int) -> tuple[int, int]:
    # a whole row's two loads: the largest power of two <= k, then the rest rounded up to one (1: none)
    block_k = 1 << (k.bit_length() - 1)
    return block_k, triton.next_power_of_2(k - block_k) if k > block_k else 1


def _whole_tile_problem(k: int, gated: bool, tile: WholeRowTile, dtype: torch.dtype) -> str | None:
    block_k, block_k2 = _whole_blocks(k)
    width = block_k + (block_k2 if k > block_k else 0)
    rows = tile.block_n * (2 if gated else 1)     # with an activation, as many up rows again
    per_register = 4 if dtype == FP8 else 1      # FP8 weights: four to an int32 word
    if rows * width > WHOLE_MAX * per_register:
        return (f"a row block of {rows} x {width} weights is over the {WHOLE_MAX * per_register} that whole rows "
                f"hold")
    return None


def _whole_linear(x, weight, bias, norm_weight, eps, residual, code, ids, tile, out, res_out, pdl_on,
                  weight_scale, scale_mode, scale_bn, scale_bk):
    k = weight.shape[1]
    block_k, block_k2 = _whole_blocks(k)
    w, w_stride = weight, weight.stride(0)
    if scale_mode != NO_SCALE:      # FP8: int32 words of four weights; a pair of words is the kernel's step
        w, w_stride, block_k2 = weight.view(torch.int32), w_stride // 4, max(block_k2, 8)
    rows, n_out = out.shape
    grid = (min(triton.cdiv(n_out, tile.block_n), tile.programs_per_sm * _num_sms(x.device)),)
    for m in range(rows):
        pointers = _pointers(x, w, bias, norm_weight, residual, ids, out, res_out, weight_scale, m)
        _gemv_whole_kernel[grid](
            *pointers, eps, n_out, w_stride, weight_scale.stride(0) if weight_scale is not None else 0,
            K=k, BLOCK_N=tile.block_n, BLOCK_K=block_k, BLOCK_K2=block_k2, NORM=norm_weight is not None,
            RESIDUAL=residual is not None, HAS_BIAS=bias is not None, ACT=code, GATHER=ids is not None,
            PDL=pdl_on, SCALE=scale_mode, SCALE_BN=scale_bn, SCALE_BK=scale_bk, ASM=x.is_cuda,
            num_warps=tile.num_warps, launch_pdl=pdl_on)
    return out, res_out
