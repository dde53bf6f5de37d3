"""The whole-row kernel of the single-token products (`gemv.fused_linear` runs it for a `WholeRowTile`): a
row block's whole rows are in flight at once, the first block's before the programmatic-dependent-launch
wait, so a row block costs one round trip to HBM.

FP8 weights (`layers/fp8_linear.Fp8Linear`, float8_e4m3fn with float32 block scales) run this kernel with
half the weight bytes, read as int32 words of four weights. Widened to float32 for an FMA each, they cost
more instructions per byte than the 16-bit kernels spend, enough to leave the product at the 16-bit one's
time; instead a pair of words meets the input as float16 pairs (see "FP8 weights" below): about 2.6
instructions per weight in the sm90 loop against 6.6 widened (docs/BENCHMARKS.md). A row's sum is
multiplied by its scale (per output channel), or each eight columns' sum by their block's. Their tile is
the shape's measured FP8 tile (`KernelConfig.fp8_tiles`), else `fp8_tile` of its 16-bit tile.

What `gemv._gemv_kernel` shares with this kernel (`input_chunk`, `pointers`, the SCALE modes) lives here, as
gemv imports this module and not the other way round.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from tokenmill.layers.kernel_config import KernelConfig, Tile, WholeRowTile
from tokenmill.layers.kernels import pdl
from tokenmill.layers.kernels.fused_ops import gate_act

FP8 = torch.float8_e4m3fn
# the kernels' SCALE: 16-bit or float32 weights as they are, FP8 with a scale per output row, FP8 with
# a scale per (block_n, block_k) block
NO_SCALE, ROW_SCALE, BLOCK_SCALE = 0, 1, 2

WHOLE_MAX = 32 * 1024   # weights in a whole-row tile's row block: its registers
# the tile of FP8 products whose 16-bit tile is not whole rows
FP8_TILE = WholeRowTile(block_n=2, num_warps=4, programs_per_sm=4)


@triton.jit
def _normed(h, nw_ptr, rstd, kk, K: tl.constexpr, NORM: tl.constexpr, dtype: tl.constexpr):
    # input columns kk, loaded (and summed with the residual) as h, in float32, normalised with the
    # rounding of rms_norm_torch: times rstd, then times the norm weight, each rounded to dtype
    if NORM:
        h = (h * rstd).to(dtype).to(tl.float32)
        h = (h * tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    return h


@triton.jit
def input_chunk(x_ptr, res_ptr, nw_ptr, rstd, k0, c, K: tl.constexpr,
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
    # the input's columns 8p .. 8p + 7 as `input_chunk` gives them, times xs, as four float16-pair vectors
    x0 = _f16_pairs(input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 0, 8 * p, K, NORM, RESIDUAL) * xs,
                    input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 1, 8 * p, K, NORM, RESIDUAL) * xs, ASM)
    x1 = _f16_pairs(input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 2, 8 * p, K, NORM, RESIDUAL) * xs,
                    input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 3, 8 * p, K, NORM, RESIDUAL) * xs, ASM)
    x2 = _f16_pairs(input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 4, 8 * p, K, NORM, RESIDUAL) * xs,
                    input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 5, 8 * p, K, NORM, RESIDUAL) * xs, ASM)
    x3 = _f16_pairs(input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 6, 8 * p, K, NORM, RESIDUAL) * xs,
                    input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 7, 8 * p, K, NORM, RESIDUAL) * xs, ASM)
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
    # `gemv._gemv_kernel` with whole rows: a row block's K columns are one load of BLOCK_K (a power of two)
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
    ha = input_chunk(x_ptr, res_ptr, nw_ptr, 1.0, 0, ca, K, False, RESIDUAL)
    hb = ha
    if TWO:
        hb = input_chunk(x_ptr, res_ptr, nw_ptr, 1.0, 0, cb, K, False, RESIDUAL)
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


def pointers(x, weight, bias, norm_weight, residual, ids, out, res_out, scale, m):
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


def whole_blocks(k: int) -> tuple[int, int]:
    # a whole row's two loads: the largest power of two <= k, then the rest rounded up to one (1: none)
    block_k = 1 << (k.bit_length() - 1)
    return block_k, triton.next_power_of_2(k - block_k) if k > block_k else 1


def whole_tile_problem(k: int, gated: bool, tile: WholeRowTile, dtype: torch.dtype) -> str | None:
    """Why `tile` cannot hold this product's rows (a gated activation after it when `gated`), or None."""
    block_k, block_k2 = whole_blocks(k)
    width = block_k + (block_k2 if k > block_k else 0)
    rows = tile.block_n * (2 if gated else 1)     # with an activation, as many up rows again
    per_register = 4 if dtype == FP8 else 1      # FP8 weights: four to an int32 word
    if rows * width > WHOLE_MAX * per_register:
        return (f"a row block of {rows} x {width} weights is over the {WHOLE_MAX * per_register} that whole rows "
                f"hold")
    return None


def whole_linear(x, weight, bias, norm_weight, eps, residual, code, ids, tile, out, res_out, pdl_on,
                 weight_scale, scale_mode, scale_bn, scale_bk, num_sms):
    """`gemv.fused_linear` with whole-row `tile`, which `whole_tile_problem` passed, on `num_sms` SMs;
    fused_linear checks the arguments and allocates the outputs."""
    k = weight.shape[1]
    block_k, block_k2 = whole_blocks(k)
    w, w_stride = weight, weight.stride(0)
    if scale_mode != NO_SCALE:      # FP8: int32 words of four weights; a pair of words is the kernel's step
        w, w_stride, block_k2 = weight.view(torch.int32), w_stride // 4, max(block_k2, 8)
    rows, n_out = out.shape
    grid = (min(triton.cdiv(n_out, tile.block_n), tile.programs_per_sm * num_sms),)
    for m in range(rows):
        _gemv_whole_kernel[grid](
            *pointers(x, w, bias, norm_weight, residual, ids, out, res_out, weight_scale, m), eps, n_out, w_stride,
            weight_scale.stride(0) if weight_scale is not None else 0,
            K=k, BLOCK_N=tile.block_n, BLOCK_K=block_k, BLOCK_K2=block_k2, NORM=norm_weight is not None,
            RESIDUAL=residual is not None, HAS_BIAS=bias is not None, ACT=code, GATHER=ids is not None,
            PDL=pdl_on, SCALE=scale_mode, SCALE_BN=scale_bn, SCALE_BK=scale_bk, ASM=x.is_cuda,
            num_warps=tile.num_warps, launch_pdl=pdl_on)
    return out, res_out
