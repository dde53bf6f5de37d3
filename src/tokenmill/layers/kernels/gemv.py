"""Single-token linear layers: one kernel per product of a one-row input with a weight matrix, with the
RMSNorm (+ residual add) before it and the SiLU-and-mul after it folded in.

A batch-1 decode step reads every weight once and does little else, so it is bound by how close each
product gets to HBM bandwidth. The weight matrices of a 3-4B model are 20-100 MB, small enough that a
library GEMM spends a good part of its time ramping up and draining; here each layer's four products
are the only kernels that read weights, the norms and the activation ride along (two kernels fewer per
layer), and with programmatic dependent launch (`pdl.py`) a product starts fetching its weights while
the kernel before it finishes.

The first product of a step can also gather its input row from the embedding table (`ids`): the step
then starts with that product, where it started with an embedding kernel.

FP8 weights (`layers/fp8_linear.Fp8Linear`, float8_e4m3fn with float32 block scales) run the same
kernels with half the weight bytes: the weights are widened to float32 in registers and the scale is
applied in float32, a row's sum times its scale (per output channel) or, for block-wise scales, the
input chunk times its block's scale before the product (a row block never straddles two scale rows).
Their tile is the shape's measured FP8 tile (`KernelConfig.fp8_tiles`), else the 16-bit tile of the
shape with twice the rows in a whole-row block (twice the columns in a register chunk), so that a
program has as many bytes in flight as the measured 16-bit tile (`fp8_tile`). Widening costs more
instructions per byte than the 16-bit kernels spend, and these products run at about the 16-bit ones'
time on an H200 rather than half of it (docs/BENCHMARKS.md).

`fused_linear` is the one entry point; `fused_linear_torch` is its reference. Which kernel and tile a
product runs is `KernelConfig.tile` (`layers/kernel_config.py`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.layers.activation import silu_and_mul_torch
from tokenmill.layers.kernel_config import KernelConfig, RegisterTile, SmemTile, Tile, WholeRowTile
from tokenmill.layers.kernels import gemv_smem, pdl
from tokenmill.layers.norm import rms_norm_torch

MAX_ROWS = 1
FP8 = torch.float8_e4m3fn
# the kernels' SCALE: 16-bit or float32 weights as they are, FP8 with a scale per output row, FP8 with
# a scale per (block_n, block_k) block
NO_SCALE, ROW_SCALE, BLOCK_SCALE = 0, 1, 2

WHOLE_MAX = 32 * 1024   # weights in a whole-row tile's row block: its registers
SHIPPED = KernelConfig()

def fused_linear_torch(x, weight, bias=None, *, norm_weight=None, eps=0.0, residual=None, silu=False,
                       ids=None):
    """Reference: y = linear(rms_norm(x + residual) * norm_weight) (each step optional), then
    silu(gate) * up over the packed [gate | up] output when `silu`. Returns (y, x + residual), the
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
    return (silu_and_mul_torch(y) if silu else y), res_out


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
def _block_scaled(xk, s_ptr, s_stride, first_row, kk, K: tl.constexpr, SCALE: tl.constexpr,
                  SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr):
    # input columns kk times the block scales of the row block from weight row first_row on (one scale
    # row: the wrapper checks that a row block never straddles two); xk itself for other weights
    if SCALE == 2:
        xk *= tl.load(s_ptr + (first_row // SCALE_BN) * s_stride + kk // SCALE_BK, mask=kk < K, other=0.0)
    return xk


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
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, ids_ptr, s_ptr, eps, n_out,
                 w_stride, s_stride, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NORM: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                 GATHER: tl.constexpr, PDL: tl.constexpr, SCALE: tl.constexpr, SCALE_BN: tl.constexpr,
                 SCALE_BK: tl.constexpr):
    # Persistent: program p computes row blocks p, p + P, ... of the output. With SILU the weight is
    # [gate | up] stacked by rows, and output row n needs weight rows n and n_out + n. With GATHER the
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
    if SILU:
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
            if SILU:
                u = tl.load(u_rows + c[None, :], mask=tile_mask, other=0.0)
        xk = _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 0, c, K, NORM, RESIDUAL)
        # per element, summed per row once the row is done
        acc = w.to(tl.float32) * _block_scaled(xk, s_ptr, s_stride, unit * BLOCK_N, c, K, SCALE, SCALE_BN,
                                               SCALE_BK)[None, :]
        acc_u = acc
        if SILU:
            acc_u = u.to(tl.float32) * _block_scaled(xk, s_ptr, s_stride, n_out + unit * BLOCK_N, c, K, SCALE,
                                                     SCALE_BN, SCALE_BK)[None, :]
        # one chunk in flight per program (num_stages=1): the registers hold the next chunk, not a pipeline
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=1):
            tile_mask = row_mask[:, None] & (k0 + c < K)[None, :]
            xk = _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, k0, c, K, NORM, RESIDUAL)
            acc += tl.load(w_rows + k0 + c[None, :], mask=tile_mask, other=0.0).to(tl.float32) * _block_scaled(
                xk, s_ptr, s_stride, unit * BLOCK_N, k0 + c, K, SCALE, SCALE_BN, SCALE_BK)[None, :]
            if SILU:
                acc_u += tl.load(u_rows + k0 + c[None, :], mask=tile_mask, other=0.0).to(tl.float32) * \
                    _block_scaled(xk, s_ptr, s_stride, n_out + unit * BLOCK_N, k0 + c, K, SCALE, SCALE_BN,
                                  SCALE_BK)[None, :]
        y = _row_scaled(tl.sum(acc, 1), s_ptr, s_stride, rows, row_mask, SCALE)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        if SILU:
            g = y.to(out_ptr.dtype.element_ty).to(tl.float32)
            up = _row_scaled(tl.sum(acc_u, 1), s_ptr, s_stride, rows + n_out, row_mask, SCALE)
            up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
            y = act * up
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _whole_rows(w_ptr, w_stride, unit, num_units, n_out, first_row, r, ca, cb, K: tl.constexpr,
                BLOCK_N: tl.constexpr, TWO: tl.constexpr):
    # every weight of row block `unit` (none past the last unit), in one or two loads issued together;
    # weight rows from first_row on (n_out: the up rows of SiLU-and-mul)
    rows = unit * BLOCK_N + r
    ok = (rows < n_out) & (unit < num_units)
    base = w_ptr + (rows + first_row).to(tl.int64)[:, None] * w_stride
    wa = _whole_loads(base + ca[None, :], ok[:, None] & (ca < K)[None, :])
    wb = wa
    if TWO:
        wb = _whole_loads(base + cb[None, :], ok[:, None] & (cb < K)[None, :])
    return wa, wb


@triton.jit
def _whole_block(w_ptr, w_stride, unit, num_units, n_out, r, ca, cb, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 TWO: tl.constexpr, SILU: tl.constexpr):
    # `_whole_rows` of row block `unit`, and with SILU of its up rows too (the same as the gate's without)
    wa, wb = _whole_rows(w_ptr, w_stride, unit, num_units, n_out, 0, r, ca, cb, K, BLOCK_N, TWO)
    ua, ub = wa, wb
    if SILU:
        ua, ub = _whole_rows(w_ptr, w_stride, unit, num_units, n_out, n_out, r, ca, cb, K, BLOCK_N, TWO)
    return wa, wb, ua, ub


@triton.jit
def _whole_sums(wa, wb, xa, xb, TWO: tl.constexpr):
    # one float per row: a row block's whole rows times the input
    y = tl.sum(wa.to(tl.float32) * xa[None, :], 1)
    if TWO:
        y += tl.sum(wb.to(tl.float32) * xb[None, :], 1)
    return y


@triton.jit
def _whole_scaled_sums(wa, wb, xa, xb, s_ptr, s_stride, first_row, rows, row_mask, ca, cb, K: tl.constexpr,
                       TWO: tl.constexpr, SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr):
    # `_whole_sums` of the row block from weight row first_row on (rows: their scale rows with ROW_SCALE)
    xsa = _block_scaled(xa, s_ptr, s_stride, first_row, ca, K, SCALE, SCALE_BN, SCALE_BK)
    xsb = xsa
    if TWO:
        xsb = _block_scaled(xb, s_ptr, s_stride, first_row, cb, K, SCALE, SCALE_BN, SCALE_BK)
    return _row_scaled(_whole_sums(wa, wb, xsa, xsb, TWO), s_ptr, s_stride, rows, row_mask, SCALE)


@triton.jit
def _gemv_whole_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, ids_ptr, s_ptr, eps, n_out,
                       w_stride, s_stride, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_K2: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SILU: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr, SCALE: tl.constexpr,
                       SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr):
    # `_gemv_kernel` with whole rows: a row block's K columns are one load of BLOCK_K (a power of two)
    # and, when K is longer, one of BLOCK_K2 more, both in flight at once, so a row block costs one
    # round trip to HBM; the first is requested before the wait, and the next row block's loads are
    # issued before this one is summed. The input is loaded (and normalised) once per program. With
    # SILU the up rows (n_out further on) come with the gate rows.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_units = tl.cdiv(n_out, BLOCK_N)
    TWO: tl.constexpr = K > BLOCK_K
    r = tl.arange(0, BLOCK_N)
    ca = tl.arange(0, BLOCK_K)
    cb = BLOCK_K + tl.arange(0, BLOCK_K2)
    wa, wb, ua, ub = _whole_block(w_ptr, w_stride, pid, num_units, n_out, r, ca, cb, K, BLOCK_N, TWO, SILU)
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

    for unit in range(pid, num_units, num_programs):
        na, nb, nua, nub = _whole_block(w_ptr, w_stride, unit + num_programs, num_units, n_out, r, ca, cb, K,
                                        BLOCK_N, TWO, SILU)
        rows = unit * BLOCK_N + r
        row_mask = rows < n_out
        y = _whole_scaled_sums(wa, wb, xa, xb, s_ptr, s_stride, unit * BLOCK_N, rows, row_mask, ca, cb, K, TWO,
                               SCALE, SCALE_BN, SCALE_BK)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        if SILU:
            g = y.to(dtype).to(tl.float32)
            up = _whole_scaled_sums(ua, ub, xa, xb, s_ptr, s_stride, n_out + unit * BLOCK_N, rows + n_out, row_mask,
                                    ca, cb, K, TWO, SCALE, SCALE_BN, SCALE_BK).to(dtype).to(tl.float32)
            y = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * up
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)
        wa, wb, ua, ub = na, nb, nua, nub


def _pointers(x, weight, bias, norm_weight, residual, ids, out, res_out, scale, m):
    # row m's tensors for the kernels' pointer arguments (x_ptr .. s_ptr); an absent one stands in as
    # a tensor of the call that the kernel does not read
    return (x if ids is not None else x[m], residual[m] if residual is not None else x,
            norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight,
            out[m], res_out[m] if residual is not None or ids is not None else out[m],
            ids[m:] if ids is not None else out[m], scale if scale is not None else weight)


def fp8_tile(tile: Tile, kernels: KernelConfig) -> Tile:
    """The tile of an FP8 product whose 16-bit tile is `tile`: as many weight bytes per program and load
    as that one (twice the rows of a whole-row block, twice the columns of a register chunk). The
    shared-memory kernel copies 16-bit rows, so its products take the default tile's FP8 counterpart."""
    if isinstance(tile, WholeRowTile):
        return dataclasses.replace(tile, block_n=2 * tile.block_n)
    if isinstance(tile, RegisterTile):
        return dataclasses.replace(tile, block_k=2 * tile.block_k)
    return fp8_tile(kernels.default_tile, kernels)


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


def _block_scale_problem(scale_mode: int, n_out: int, silu: bool, block_n: int, scale_bn: int) -> str | None:
    # with block scales, a row block (gate and up rows alike) must lie within one row of scales
    if scale_mode == BLOCK_SCALE and (scale_bn % block_n or (silu and n_out % block_n)):
        return (f"a row block of {block_n} rows straddles scale blocks of {scale_bn} rows"
                f"{f' (or the up rows from {n_out} on)' if silu else ''}")
    return None


def _num_sms(device: torch.device) -> int:
    from tokenmill.layers.kernels.paged_attention import _num_sms
    return _num_sms(device.index or 0) if device.type == "cuda" else 4


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                 residual: torch.Tensor | None = None, silu: bool = False,
                 tile: Tile | None = None, kernels: KernelConfig = SHIPPED, ids: torch.Tensor | None = None,
                 weight_scale: torch.Tensor | None = None, weight_block: tuple[int, int] | None = None):
    """`fused_linear_torch` for x [M, K] with M <= MAX_ROWS, in one kernel per row. Returns
    (y, residual_out): y is [M, N] ([M, N / 2] with silu); residual_out is x + residual when both a
    norm and a residual are given, x when only the norm is, else None.

    The kernel runs `tile`, which must suit the product, or else `kernels.tile(N, K, silu)`, which falls
    back to `kernels.default_tile` where it does not (a shared-memory tile for a float32 product).

    An FP8 weight (float8_e4m3fn) comes with `weight_scale` (float32 [ceil(N / bn), ceil(K / bk)]) and
    `weight_block` (bn, bk): W = weight * weight_scale of its block, (1, K) being per output channel. Its
    tile is the shape's in `kernels.fp8_tiles`, else `fp8_tile` of its 16-bit tile (an explicit `tile` runs as
    given).

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
    if silu and (n % 2 or bias is not None):
        raise ValueError(f"fused_linear: silu needs an even number of weight rows (got {n}) and no bias")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"fused_linear: bias must be [{n}], got {tuple(bias.shape)}")
    if residual is not None and (norm_weight is None or residual.shape != x.shape
                                 or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"fused_linear: a residual {tuple(residual.shape)} needs a norm and must match "
                         f"x {tuple(x.shape)} {x.dtype}")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.stride(0) != 1):
        raise ValueError(f"fused_linear: norm_weight must be [{k}], got {tuple(norm_weight.shape)}")
    explicit = tile is not None
    tile = tile if explicit else kernels.tile(n, k, silu)
    if scale_mode != NO_SCALE and not explicit:
        tile = kernels.fp8_tile(n, k, silu) or fp8_tile(tile, kernels)
    if isinstance(tile, SmemTile) and ids is not None:   # that kernel reads its input as given: gather first
        return fused_linear(F.embedding(ids, x), weight, bias, norm_weight=norm_weight, eps=eps, silu=silu,
                            tile=tile if explicit else None, kernels=kernels, weight_scale=weight_scale,
                            weight_block=weight_block)
    rows = x.shape[0] if ids is None else ids.shape[0]
    n_out = n // 2 if silu else n
    out = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    res_out = None
    if norm_weight is not None:
        res_out = torch.empty_like(x) if residual is not None else x
        if ids is not None:
            res_out = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    pdl_on = pdl.enabled(x.device)
    why = None
    if isinstance(tile, SmemTile):
        why = "FP8 weights: the shared-memory kernel copies 16-bit rows" if scale_mode != NO_SCALE else \
            gemv_smem.check_tile(n, k, silu, x.dtype, tile)
        if why is None:
            for m in range(x.shape[0]):
                gemv_smem.smem_linear(x[m], weight, bias, norm_weight, eps,
                                      residual[m] if residual is not None else None, silu, out[m],
                                      res_out[m] if residual is not None else None, tile, pdl_on)
            return out, res_out
    elif isinstance(tile, WholeRowTile):
        why = _whole_tile_problem(k, silu, tile) or _block_scale_problem(scale_mode, n_out, silu, tile.block_n,
                                                                          scale_bn)
        if why is None:
            return _whole_linear(x, weight, bias, norm_weight, eps, residual, silu, ids, tile, out, res_out,
                                 pdl_on, weight_scale, scale_mode, scale_bn, scale_bk)
    elif isinstance(tile, RegisterTile):
        why = _block_scale_problem(scale_mode, n_out, silu, tile.block_n, scale_bn)
    else:
        raise TypeError(f"fused_linear: {tile!r} is not a tile")
    if why is not None:
        if explicit:
            raise ValueError(f"fused_linear: {tile} for weight {tuple(weight.shape)}: {why}")
        tile = kernels.default_tile if scale_mode == NO_SCALE else fp8_tile(kernels.default_tile, kernels)
        if _block_scale_problem(scale_mode, n_out, silu, tile.block_n, scale_bn):
            tile = dataclasses.replace(tile, block_n=1)     # one row never straddles
    block_n, block_k = tile.block_n, min(tile.block_k, triton.next_power_of_2(k))
    grid = (min(triton.cdiv(n_out, block_n), tile.programs_per_sm * _num_sms(x.device)),)
    for m in range(rows):
        _gemv_kernel[grid](
            *_pointers(x, weight, bias, norm_weight, residual, ids, out, res_out, weight_scale, m), eps, n_out,
            weight.stride(0), weight_scale.stride(0) if weight_scale is not None else 0,
            K=k, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None,
            RESIDUAL=residual is not None, HAS_BIAS=bias is not None, SILU=silu, GATHER=ids is not None,
            PDL=pdl_on, SCALE=scale_mode, SCALE_BN=scale_bn, SCALE_BK=scale_bk, num_warps=tile.num_warps,
            launch_pdl=pdl_on)
    return out, res_out


def _whole_blocks(k: int) -> tuple[int, int]:
    # a whole row's two loads: the largest power of two <= k, then the rest rounded up to one (1: none)
    block_k = 1 << (k.bit_length() - 1)
    return block_k, triton.next_power_of_2(k - block_k) if k > block_k else 1


def _whole_tile_problem(k: int, silu: bool, tile: WholeRowTile) -> str | None:
    block_k, block_k2 = _whole_blocks(k)
    width = block_k + (block_k2 if k > block_k else 0)
    rows = tile.block_n * (2 if silu else 1)     # with silu, as many up rows again
    if rows * width > WHOLE_MAX:
        return f"a row block of {rows} x {width} weights is over the {WHOLE_MAX} that whole rows hold"
    return None


def _whole_linear(x, weight, bias, norm_weight, eps, residual, silu, ids, tile, out, res_out, pdl_on,
                  weight_scale, scale_mode, scale_bn, scale_bk):
    k = weight.shape[1]
    block_k, block_k2 = _whole_blocks(k)
    rows, n_out = out.shape
    grid = (min(triton.cdiv(n_out, tile.block_n), tile.programs_per_sm * _num_sms(x.device)),)
    for m in range(rows):
        _gemv_whole_kernel[grid](
            *_pointers(x, weight, bias, norm_weight, residual, ids, out, res_out, weight_scale, m), eps, n_out,
            weight.stride(0), weight_scale.stride(0) if weight_scale is not None else 0,
            K=k, BLOCK_N=tile.block_n, BLOCK_K=block_k, BLOCK_K2=block_k2, NORM=norm_weight is not None,
            RESIDUAL=residual is not None, HAS_BIAS=bias is not None, SILU=silu, GATHER=ids is not None,
            PDL=pdl_on, SCALE=scale_mode, SCALE_BN=scale_bn, SCALE_BK=scale_bk, num_warps=tile.num_warps,
            launch_pdl=pdl_on)
    return out, res_out
