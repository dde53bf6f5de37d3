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

FP8 weights (`layers/fp8_linear.Fp8Linear`) run the whole-row kernel (`gemv_whole.py`), their products in
float16 pairs; their tile is the shape's measured FP8 tile (`KernelConfig.fp8_tiles`), else
`gemv_whole.fp8_tile` of its 16-bit tile.

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
from tokenmill.layers.kernels import gemv_smem, gemv_whole, pdl
from tokenmill.layers.kernels.fused_ops import gate_act
from tokenmill.layers.kernels.gemv_whole import BLOCK_SCALE, FP8, FP8_TILE, NO_SCALE, ROW_SCALE, input_chunk
from tokenmill.layers.norm import rms_norm_torch

MAX_ROWS = 1
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
            h = input_chunk(x_ptr, res_ptr, nw_ptr, 1.0, k0, c, K, False, RESIDUAL)
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
        xk = input_chunk(x_ptr, res_ptr, nw_ptr, rstd, 0, c, K, NORM, RESIDUAL)
        # per element, summed per row once the row is done
        acc = w.to(tl.float32) * xk[None, :]
        acc_u = acc
        if ACT != 0:
            acc_u = u.to(tl.float32) * xk[None, :]
        # one chunk in flight per program (num_stages=1): the registers hold the next chunk, not a pipeline
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=1):
            tile_mask = row_mask[:, None] & (k0 + c < K)[None, :]
            xk = input_chunk(x_ptr, res_ptr, nw_ptr, rstd, k0, c, K, NORM, RESIDUAL)
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
    runs a whole-row tile: the shape's in `kernels.fp8_tiles`, else `gemv_whole.fp8_tile` of its 16-bit tile
    (an explicit `tile` runs as given). Its products take the input in float16 (`gemv_whole.py`); a K or a
    block of columns that is not a multiple of 8 has its weight dequantized for the call instead.

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
                                   or gemv_whole.whole_tile_problem(k, gated, one_row, FP8)):
        from tokenmill.quant.fp8 import dequantize
        return fused_linear(x, dequantize(weight, weight_scale, weight_block).to(x.dtype), bias,
                            norm_weight=norm_weight, eps=eps, residual=residual, act=act, kernels=kernels, ids=ids)
    if scale_mode != NO_SCALE:
        if not explicit:
            tile = gemv_whole.fp8_tile_of(kernels, n, k, gated)
        why = ("FP8 weights run whole-row tiles" if not isinstance(tile, WholeRowTile) else
               gemv_whole.whole_tile_problem(k, gated, tile, FP8)
               or _block_scale_problem(scale_mode, n_out, gated, tile.block_n, scale_bn))
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
        why = gemv_whole.whole_tile_problem(k, gated, tile, weight.dtype)
        if why is None:
            return gemv_whole.whole_linear(x, weight, bias, norm_weight, eps, residual, code, ids, tile, out,
                                           res_out, pdl_on, weight_scale, scale_mode, scale_bn, scale_bk,
                                           _num_sms(x.device))
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
            *gemv_whole.pointers(x, weight, bias, norm_weight, residual, ids, out, res_out, None, m)[:8], eps, n_out,
            weight.stride(0), K=k, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None,
            RESIDUAL=residual is not None, HAS_BIAS=bias is not None, ACT=code, GATHER=ids is not None,
            PDL=pdl_on, num_warps=tile.num_warps, launch_pdl=pdl_on)
    return out, res_out

