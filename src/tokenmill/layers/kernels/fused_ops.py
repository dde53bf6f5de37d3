"""Triton element-wise kernels: RMSNorm (+ fused residual add) and the gated activation (SiLU- or GELU-and-mul);
the attention prologue after the qkv projection is attention_prologue.py.

References: `rms_norm_torch` (norm.py), `act_and_mul_torch` (activation.py). Each kernel rounds
intermediates to the input dtype where the reference does, so results match it to the last bit or one
rounding step. Before an FP8 product, RMSNorm and the gated activation write their rows in E4M3 with their
scales (`fp8_group`): the rows they would write otherwise, quantized as the product would quantize them
(`fp8_gemm.input_group`). A product's sums before their scales (`UnscaledRows`) are scaled as they are
loaded (`scaled_load`). Inputs need a unit stride on the last dim only; token and head strides are free.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.activation import check_activation
from tokenmill.layers.attention import FP8_KV_MAX
from tokenmill.layers.kernels import pdl
from tokenmill.quant.fp8 import FP8, Fp8Rows, UnscaledRows

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_MAX = tl.constexpr(FP8_KV_MAX)   # E4M3's largest value, 448, for the cache and the products' inputs


def check_dtype(name: str, x: torch.Tensor) -> None:
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name}: unsupported dtype {x.dtype}; supported: {_DTYPES}")


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [A, B, N] without copying when the leading dims allow it."""
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.reshape(-1, x.shape[-2], x.shape[-1])


# ------------------------------------------------------------------------------------------ rms norm


@triton.jit
def _fp8_groups(y, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    # y [BLOCK_R, BLOCK_N] float32, zero where masked -> (FP8 values [BLOCK_R, BLOCK_N], scales
    # [BLOCK_R, BLOCK_N // GROUP]): each GROUP columns over their absmax / FP8_MAX, as quantize_rows does
    g = tl.reshape(y, [BLOCK_R, BLOCK_N // GROUP, GROUP])
    scale = tl.maximum(tl.max(tl.abs(g), 2), 1e-12) / FP8_MAX
    q = tl.clamp(g / scale[:, :, None], -FP8_MAX, FP8_MAX)
    return tl.reshape(q, [BLOCK_R, BLOCK_N]).to(tl.float8e4nv), scale


# num_rows unspecialized: an eager step's row count (a prefill burst above every graph) reuses the variant
# that the largest step compiled at start, rather than compiling one inside a served step
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, s_ptr, rs_ptr, cs_ptr, eps, num_rows, inner,
                     x_stride_a, x_stride_b, r_stride_a, r_stride_b, s_stride,
                     N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, FP8_GROUP: tl.constexpr, UNSCALED: tl.constexpr,
                     PDL: tl.constexpr):
    # rows are (a, b) pairs of the [A, B, N] view; outputs are contiguous [A * B, N]. FP8_GROUP > 0: out is
    # FP8, the rows as the plain kernel writes them quantized with a scale per FP8_GROUP columns (BLOCK_N:
    # per row) into s_ptr. UNSCALED: x is a product's float32 sums, scaled by its rows' (rs_ptr) and
    # columns' (cs_ptr) scales and rounded to the residual's dtype first, as `UnscaledRows` says
    pdl.enter(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_N)
    r_mask = r < num_rows
    mask = r_mask[:, None] & (c < N)[None, :]
    a = (r // inner).to(tl.int64)
    b = (r % inner).to(tl.int64)
    x = tl.load(x_ptr + (a * x_stride_a + b * x_stride_b)[:, None] + c[None, :], mask=mask, other=0.0)
    if UNSCALED:
        rs = tl.load(rs_ptr + r, mask=r_mask, other=0.0)
        cs = tl.load(cs_ptr + c, mask=c < N, other=0.0)
        x = (x * rs[:, None] * cs[None, :]).to(res_ptr.dtype.element_ty)
    out_rows = r.to(tl.int64)[:, None] * N + c[None, :]
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + (a * r_stride_a + b * r_stride_b)[:, None] + c[None, :], mask=mask,
                      other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + out_rows, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 1) / N + eps)
    h = (h * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
    if FP8_GROUP > 0:
        q, scale = _fp8_groups((h * w[None, :]).to(x.dtype).to(tl.float32), BLOCK_R, BLOCK_N, FP8_GROUP)
        tl.store(out_ptr + out_rows, q, mask=mask)
        g = tl.arange(0, BLOCK_N // FP8_GROUP)
        tl.store(s_ptr + r.to(tl.int64)[:, None] * s_stride + g[None, :], scale,
                 mask=r_mask[:, None] & (g < tl.cdiv(N, FP8_GROUP))[None, :])
    else:
        tl.store(out_ptr + out_rows, (h * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _fp8_out(name: str, rows: int, n: int, group: int, x: torch.Tensor):
    """The FP8 output of a kernel quantizing its rows [rows, n] with `group` columns a scale (at least n:
    one a row), as `quant/fp8.Fp8Rows` takes them, and the group the kernel uses within its block of
    columns. A group narrower than the row must be a power of two."""
    if group < n and group & (group - 1):
        raise ValueError(f"{name}: an FP8 group of {group} columns narrower than the row ({n}) must be a "
                         "power of two")
    group = min(group, n)
    q = torch.empty(rows, n, dtype=FP8, device=x.device)
    scale = torch.empty(rows, triton.cdiv(n, group), dtype=torch.float32, device=x.device)
    return q, scale, group


def rms_norm(x: torch.Tensor | UnscaledRows, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             fp8_group: int | None = None):
    """RMSNorm over the last dim of x [..., N]. Returns `out` when residual is None, else
    `(out, x + residual)`; both are new contiguous tensors (the inputs are not modified).
    out has dtype promote(weight.dtype, x.dtype), as in the reference. `fp8_group` (x 2-D, weight of x's
    dtype): out comes as `quant/fp8.Fp8Rows`, equal to `quantize_rows(out, fp8_group)` of the plain one.
    x may be an FP8 product before its scales (`quant/fp8.UnscaledRows`, with a residual of its dtype):
    the kernel scales it as it loads it, with the results of the scaled tensor."""
    unscaled = x if isinstance(x, UnscaledRows) else None
    if unscaled is not None:
        if residual is None or unscaled.raw.dim() != 2:
            raise ValueError("rms_norm: an unscaled product [T, N] takes a residual")
        x = unscaled.raw
    check_dtype("rms_norm x", x)
    check_dtype("rms_norm weight", weight)
    dtype = x.dtype if unscaled is None else unscaled.dtype
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({n},)")
    if x.stride(-1) != 1 or weight.stride(0) != 1:
        raise ValueError(f"rms_norm: x and weight need a unit last stride, got {x.stride()}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != dtype or residual.stride(-1) != 1:
            raise ValueError(f"rms_norm: residual {residual.dtype} {tuple(residual.shape)} must match x "
                             f"{dtype} {tuple(x.shape)} and have a unit last stride")
    x3 = _as_3d(x)
    r3 = _as_3d(residual) if residual is not None else x3
    num_rows = x3.shape[0] * x3.shape[1]
    block_n = triton.next_power_of_2(n)
    if fp8_group is not None:
        if x.dim() != 2 or weight.dtype != dtype:
            raise ValueError(f"rms_norm: FP8 output takes x [T, N] and a weight of x's dtype, got x {dtype} "
                             f"{tuple(x.shape)}, weight {weight.dtype}")
        out, scale, group = _fp8_out("rms_norm", num_rows, n, fp8_group, x)
        kernel_group = block_n if group == n else group
    else:
        out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, dtype), device=x.device)
        scale, kernel_group = out, 0
    res_out = torch.empty(x.shape, dtype=dtype, device=x.device) if residual is not None else out
    rs, cs = (unscaled.row_scale, unscaled.col_scale) if unscaled is not None else (x, x)
    if num_rows > 0:
        block_r = max(1, min(16, 2048 // block_n))
        pdl_on = pdl.enabled(x.device)
        _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            x3, r3, weight, out, res_out, scale, rs, cs, eps, num_rows, x3.shape[1],
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), scale.stride(0),
            N=n, BLOCK_R=block_r, BLOCK_N=block_n, HAS_RESIDUAL=residual is not None, FP8_GROUP=kernel_group,
            UNSCALED=unscaled is not None, PDL=pdl_on, num_warps=8 if block_n >= 4096 else 4, launch_pdl=pdl_on)
    if fp8_group is not None:
        out = Fp8Rows(out, scale, fp8_group, dtype)
    return out if residual is None else (out, res_out)


# -------------------------------------------------------------------------------- gated activation


@triton.jit
def gate_act(g, ACT: tl.constexpr):
    # act(g) of a float32 gate, ACT as `activation.ACTIVATIONS` numbers it: SiLU g sigmoid(g) (1), or GELU's
    # tanh approximation (2), g (1 + tanh(u)) / 2 with u = sqrt(2 / pi) (g + 0.044715 g^3), taken as the equal
    # g sigmoid(2u): one exp as SiLU's, and no 1 + tanh(u) that cancels for negative g. Past the exp's
    # range (u < -44) the sigmoid is 0 and g / inf gives it
    if ACT == 2:
        return g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))
    else:
        return g / (1.0 + tl.exp(-g))


@triton.jit
def scaled_load(src_ptr, cs_ptr, offs, mask, rs, UNSCALED: tl.constexpr, DTYPE: tl.constexpr):
    # src_ptr[offs] (0 outside mask); UNSCALED: a product's sums, times the row's scale rs and each column's
    # scale cs_ptr[offs] (cs_ptr at src_ptr's first column), rounded to DTYPE, as `UnscaledRows` says
    x = tl.load(src_ptr + offs, mask=mask, other=0.0)
    if UNSCALED:
        x = (x.to(tl.float32) * rs * tl.load(cs_ptr + offs, mask=mask, other=0.0)).to(DTYPE)
    return x


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, s_ptr, rs_ptr, cs_ptr, x_stride_t, s_stride, I: tl.constexpr,
                        BLOCK: tl.constexpr, FP8_GROUP: tl.constexpr, UNSCALED: tl.constexpr, DTYPE: tl.constexpr,
                        PDL: tl.constexpr, ACT: tl.constexpr):
    # program (t, j): columns j * BLOCK ... of token t. FP8_GROUP > 0: out is FP8, the values as the plain
    # kernel writes them quantized with a scale per FP8_GROUP columns (BLOCK: per block, which then spans
    # the row) into s_ptr. UNSCALED: x is a product's sums, scaled by its row's (rs_ptr) and columns'
    # (cs_ptr) scales and rounded to the product's dtype DTYPE first, as `UnscaledRows` says
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < I
    rs = 1.0
    if UNSCALED:
        rs = tl.load(rs_ptr + t)
    gate = scaled_load(x_ptr + t * x_stride_t, cs_ptr, c, mask, rs, UNSCALED, DTYPE)
    up = scaled_load(x_ptr + t * x_stride_t, cs_ptr, I + c, mask, rs, UNSCALED, DTYPE)
    act = gate_act(gate.to(tl.float32), ACT).to(gate.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    if FP8_GROUP > 0:
        q, scale = _fp8_groups(tl.reshape(y.to(tl.float32), [1, BLOCK]), 1, BLOCK, FP8_GROUP)
        tl.store(out_ptr + t * I + c, tl.reshape(q, [BLOCK]), mask=mask)
        j = tl.program_id(1) * (BLOCK // FP8_GROUP) + tl.arange(0, BLOCK // FP8_GROUP)
        tl.store(s_ptr + t * s_stride + j, tl.reshape(scale, [BLOCK // FP8_GROUP]), mask=j < tl.cdiv(I, FP8_GROUP))
    else:
        tl.store(out_ptr + t * I + c, y, mask=mask)


TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def act_and_mul(x: torch.Tensor | UnscaledRows, act: str = "silu", fp8_group: int | None = None):
    """x [..., 2I] packed as [gate | up] -> act(gate) * up, [..., I] (contiguous); `act` an activation of
    `activation.ACTIVATIONS`. `fp8_group` (x 2-D): the result comes as `quant/fp8.Fp8Rows`, equal to
    `quantize_rows(out, fp8_group)` of the plain one. x may be an FP8 product before its scales
    (`quant/fp8.UnscaledRows`): the kernel scales it as it loads it, with the results of the scaled tensor."""
    code = check_activation(act)
    unscaled = x if isinstance(x, UnscaledRows) else None
    if unscaled is not None:
        if unscaled.raw.dim() != 2:
            raise ValueError(f"act_and_mul: an unscaled product is [T, 2I], got {tuple(unscaled.raw.shape)}")
        x = unscaled.raw
    check_dtype("act_and_mul x", x)
    dtype = x.dtype if unscaled is None else unscaled.dtype
    if x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"act_and_mul: last dim must be even with unit stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    block = min(1024, triton.next_power_of_2(inter))
    if fp8_group is not None:
        if x.dim() != 2:
            raise ValueError(f"act_and_mul: FP8 output takes x [T, 2I], got {tuple(x.shape)}")
        out, scale, group = _fp8_out("act_and_mul", x.shape[0], inter, fp8_group, x)
        if group == inter:
            # a program takes the whole row, to see its absmax, at 8 warps: for 9,728 columns on an H200,
            # 3.7-28.2 us at 64-2,048 rows against 4.4-37.0 at 16 warps and 3.9-37.2 at 32
            # (lab/fused_quant_bench.py)
            block = kernel_group = triton.next_power_of_2(inter)
        else:
            block, kernel_group = max(block, group), group
    else:
        out = torch.empty((*x.shape[:-1], inter), dtype=dtype, device=x.device)
        scale, kernel_group = out, 0
    rs, cs = (unscaled.row_scale, unscaled.col_scale) if unscaled is not None else (x, x)
    if x2.shape[0] > 0 and inter > 0:
        pdl_on = pdl.enabled(x.device)
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, scale, rs, cs, x2.stride(0), scale.stride(0), I=inter, BLOCK=block, FP8_GROUP=kernel_group,
            UNSCALED=unscaled is not None, DTYPE=TL_DTYPES[dtype], PDL=pdl_on, ACT=code,
            num_warps=4 if block <= 1024 else 8, launch_pdl=pdl_on)
    if fp8_group is not None:
        out = Fp8Rows(out, scale, fp8_group, dtype)
    return out
