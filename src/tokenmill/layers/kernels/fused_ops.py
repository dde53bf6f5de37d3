"""Triton element-wise kernels: RMSNorm (+ fused residual add), the gated activation (SiLU- or GELU-and-mul),
and the fused attention prologue (per-head q/k norm + rotary + KV-cache store) that follows the qkv projection.

References: `rms_norm_torch` (norm.py), `act_and_mul_torch` (activation.py), `apply_rotary_torch`
(rotary.py) and `store_kvcache_torch` (attention.py) for the prologue. Each kernel rounds intermediates
to the input dtype where the reference does, so results match it to the last bit or one rounding step.
An FP8 cache (attention.py) receives K / scale and V / scale saturated to E4M3 (`quantize_kv`). Before
an FP8 product, RMSNorm and the gated activation write their rows in E4M3 with their scales (`fp8_group`): the
rows they would write otherwise, quantized as the product would quantize them (`fp8_gemm.input_group`).
Inputs need a unit stride on the last dim only; token and head strides are free, so views split from
the packed qkv projection work as they are.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.activation import check_activation
from tokenmill.layers.attention import FP8_KV_DTYPE, FP8_KV_MAX, check_kv_scale
from tokenmill.layers.kernels import pdl
from tokenmill.quant.fp8 import FP8, Fp8Rows, UnscaledRows

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_MAX = tl.constexpr(FP8_KV_MAX)   # E4M3's largest value, 448, for the cache and the products' inputs


def _check_dtype(name: str, x: torch.Tensor) -> None:
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


@triton.jit
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
    _check_dtype("rms_norm x", x)
    _check_dtype("rms_norm weight", weight)
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
def _scaled_load(src_ptr, cs_ptr, offs, mask, rs, UNSCALED: tl.constexpr, DTYPE: tl.constexpr):
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
    gate = _scaled_load(x_ptr + t * x_stride_t, cs_ptr, c, mask, rs, UNSCALED, DTYPE)
    up = _scaled_load(x_ptr + t * x_stride_t, cs_ptr, I + c, mask, rs, UNSCALED, DTYPE)
    act = gate_act(gate.to(tl.float32), ACT).to(gate.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    if FP8_GROUP > 0:
        q, scale = _fp8_groups(tl.reshape(y.to(tl.float32), [1, BLOCK]), 1, BLOCK, FP8_GROUP)
        tl.store(out_ptr + t * I + c, tl.reshape(q, [BLOCK]), mask=mask)
        j = tl.program_id(1) * (BLOCK // FP8_GROUP) + tl.arange(0, BLOCK // FP8_GROUP)
        tl.store(s_ptr + t * s_stride + j, tl.reshape(scale, [BLOCK // FP8_GROUP]), mask=j < tl.cdiv(I, FP8_GROUP))
    else:
        tl.store(out_ptr + t * I + c, y, mask=mask)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


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
    _check_dtype("act_and_mul x", x)
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
            UNSCALED=unscaled is not None, DTYPE=_TL_DTYPES[dtype], PDL=pdl_on, ACT=code,
            num_warps=4 if block <= 1024 else 8, launch_pdl=pdl_on)
    if fp8_group is not None:
        out = Fp8Rows(out, scale, fp8_group, dtype)
    return out


# ---------------------------------------------------------------- q/k norm + rotary + KV-cache store


@triton.jit
def norm_weights(w_ptr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    # a head's norm weight as two [1, BLOCK_HALF] float32 halves (ones without a norm)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    if HAS_NORM:
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    else:
        w1 = tl.full([1, BLOCK_HALF], 1.0, tl.float32)
        w2 = w1
    return w1, w2


@triton.jit
def _heads(src_ptr, rs, cs_ptr, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
           BLOCK_HALF: tl.constexpr, UNSCALED: tl.constexpr, DTYPE: tl.constexpr):
    # the two halves of NUM_HEADS heads from src_ptr (heads 2 * HALF apart; `_scaled_load`, cs_ptr the column
    # scales of src_ptr's first column), and their mask
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (d < HALF)
    x1 = _scaled_load(src_ptr, cs_ptr, h * (2 * HALF) + d, mask, rs, UNSCALED, DTYPE)
    x2 = _scaled_load(src_ptr, cs_ptr, h * (2 * HALF) + HALF + d, mask, rs, UNSCALED, DTYPE)
    return x1, x2, mask


@triton.jit
def norm_rope(src_ptr, w1, w2, eps, cos, sin, rs, cs_ptr,
              NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
              BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr, UNSCALED: tl.constexpr, DTYPE: tl.constexpr):
    # NUM_HEADS heads of one token from src_ptr (heads 2 * HALF apart, loaded by `_heads`), normalised with
    # the halves w1, w2 of `norm_weights` and rotated: the two halves and their mask. Rounds like rms_norm
    # then apply_rotary_torch: normalised value -> input dtype, times weight in fp32 -> input dtype, rotated
    # in fp32 -> input dtype
    x1, x2, mask = _heads(src_ptr, rs, cs_ptr, NUM_HEADS, BLOCK_H, HALF, BLOCK_HALF, UNSCALED, DTYPE)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)[:, None]
        f1 = ((f1 * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        f2 = ((f2 * rstd).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    return (f1 * cos - f2 * sin).to(x1.dtype), (f2 * cos + f1 * sin).to(x1.dtype), mask


@triton.jit
def quantize_kv(x, scale, FP8: tl.constexpr):
    # with FP8: x / scale clamped to E4M3's range, then rounded to it (the cast alone may give NaN);
    # else x unchanged
    if FP8:
        y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)
        return y.to(tl.float8e4nv)
    else:
        return x


@triton.jit
def fp8_kv_operand(x, FP8: tl.constexpr):
    # q for the products with an FP8 cache's K/V: float16 when q is bfloat16. E4M3 widens to float16 in
    # one instruction per two values and to bfloat16 only through float16 and a second conversion per
    # value, which left the loops instruction-bound; float16 holds E4M3 exactly, and q (clamped into its
    # range) and p in [0, 1] with more mantissa bits than bfloat16. Without FP8, or in float16 or
    # float32, x unchanged.
    if FP8 and x.dtype == tl.bfloat16:
        return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    else:
        return x


@triton.jit
def widen_e4m3(x):
    # an E4M3 tile -> float16 (exact) by the conversion instruction, in inline assembly marked impure:
    # Triton traces a product's operands back through element-wise ops, and one that reaches 8-bit values
    # gives every operand of the product, and of the products sharing them (q, P), 4-wide k packs that
    # 16-bit HMMA operands do not have natively (moves, q reloaded, P through shared memory each tile);
    # the trace does not cross this op. GPU only (the interpreter runs no assembly).
    return tl.inline_asm_elementwise(
        "{.reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi;}",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def fp8_v_tile(v, dtype: tl.constexpr, FP8: tl.constexpr, WIDEN_ASM: tl.constexpr):
    # a V tile for p @ V in the operand dtype; from an FP8 cache unscaled (V's scale multiplies the
    # output) and widened by `widen_e4m3` where WIDEN_ASM (compiled for a GPU) and the operand is float16
    # (a float32 model takes the plain conversion). Widened in registers without the assembly, the
    # product reads V from shared memory a byte at a time, about 75% more instructions per tile than the
    # bf16 kernels spend.
    if FP8 and WIDEN_ASM and dtype == tl.float16:
        return widen_e4m3(v)
    else:
        return v.to(dtype)


@triton.jit
def load_kv_scales(kv_scale_ptr, FP8: tl.constexpr):
    # the layer's (K, V) scales of an FP8 cache; 1.0 for a cache in the model dtype
    if FP8:
        return tl.load(kv_scale_ptr), tl.load(kv_scale_ptr + 1)
    else:
        return 1.0, 1.0


@triton.jit
def _qk_norm_rope_store_kernel(qkv_ptr, positions_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, eps,
                               q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_scale_ptr, rs_ptr, col_scale_ptr,
                               qkv_stride_t, cs_stride,
                               NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                               BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                               HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                               FP8: tl.constexpr, UNSCALED: tl.constexpr, DTYPE: tl.constexpr, PDL: tl.constexpr):
    # one program per token; the row is [q heads | k heads | v heads], each head 2 * HALF wide. UNSCALED:
    # the row is an FP8 product's sums, scaled by the row's (rs_ptr) and columns' (col_scale_ptr) scales
    # as it is loaded (`_heads`)
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + t * qkv_stride_t
    rs = 1.0
    if UNSCALED:
        rs = tl.load(rs_ptr + t)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * cs_stride + d, mask=d < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * cs_stride + HALF + d, mask=d < HALF, other=0.0)

    qw1, qw2 = norm_weights(q_w_ptr, HALF, BLOCK_HALF, HAS_NORM)
    q1, q2, q_mask = norm_rope(row, qw1, qw2, eps, cos, sin, rs, col_scale_ptr, NUM_Q_HEADS, BLOCK_HQ, HALF,
                               BLOCK_HALF, HAS_NORM, UNSCALED, DTYPE)
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    q_dst = q_ptr + t * (NUM_Q_HEADS * 2 * HALF) + hq * (2 * HALF) + d
    tl.store(q_dst, q1, mask=q_mask)
    tl.store(q_dst + HALF, q2, mask=q_mask)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # padding tokens (slot -1) leave the cache untouched
        k_src = row + NUM_Q_HEADS * 2 * HALF
        k_cols = col_scale_ptr + NUM_Q_HEADS * 2 * HALF
        kw1, kw2 = norm_weights(k_w_ptr, HALF, BLOCK_HALF, HAS_NORM)
        k1, k2, kv_mask = norm_rope(k_src, kw1, kw2, eps, cos, sin, rs, k_cols, NUM_KV_HEADS, BLOCK_HKV, HALF,
                                    BLOCK_HALF, HAS_NORM, UNSCALED, DTYPE)
        hkv = tl.arange(0, BLOCK_HKV)[:, None]
        dst = slot * (NUM_KV_HEADS * 2 * HALF) + hkv * (2 * HALF) + d
        k_scale, v_scale = load_kv_scales(kv_scale_ptr, FP8)
        tl.store(k_cache_ptr + dst, quantize_kv(k1, k_scale, FP8), mask=kv_mask)
        tl.store(k_cache_ptr + dst + HALF, quantize_kv(k2, k_scale, FP8), mask=kv_mask)
        v1, v2, _ = _heads(k_src + NUM_KV_HEADS * 2 * HALF, rs, k_cols + NUM_KV_HEADS * 2 * HALF, NUM_KV_HEADS,
                           BLOCK_HKV, HALF, BLOCK_HALF, UNSCALED, DTYPE)
        tl.store(v_cache_ptr + dst, quantize_kv(v1, v_scale, FP8), mask=kv_mask)
        tl.store(v_cache_ptr + dst + HALF, quantize_kv(v2, v_scale, FP8), mask=kv_mask)


def check_prologue_inputs(name: str, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                          q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                          num_kv_heads: int, head_dim: int, kv_scale: torch.Tensor | None = None,
                          dtype: torch.dtype | None = None) -> None:
    """The checks of `qk_norm_rope_store`'s inputs, shared by the kernels that start from a packed qkv;
    errors name the calling function. `dtype`: the rows' dtype where qkv holds a product's sums before
    their scales (`UnscaledRows.raw`); qkv's own by default."""
    _check_dtype(f"{name} qkv", qkv)
    dtype = dtype or qkv.dtype
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"{name}: qkv must be [T, {width}] = [T, ({num_heads} + 2 * "
                         f"{num_kv_heads}) * {head_dim}] with unit last stride, got shape "
                         f"{tuple(qkv.shape)} strides {qkv.stride()}")
    if head_dim % 2:
        raise ValueError(f"{name}: head_dim must be even, got {head_dim}")
    num_tokens = qkv.shape[0]
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: positions must be int32/int64 [{num_tokens}], got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: slot_mapping must be int32/int64 [{num_tokens}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if not (positions.is_contiguous() and slot_mapping.is_contiguous()):
        raise ValueError(f"{name}: positions and slot_mapping must be contiguous")
    if (cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim
            or cos_sin.stride(1) != 1):
        raise ValueError(f"{name}: cos_sin must be float32 [max_pos, {head_dim}] with unit "
                         f"inner stride, got {cos_sin.dtype} {tuple(cos_sin.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError(f"{name}: q_weight and k_weight must both be given or both be None")
    for arg, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (head_dim,) or w.dtype != dtype or w.stride(0) != 1):
            raise ValueError(f"{name}: {arg} must be {dtype} [{head_dim}] with unit "
                             f"stride, got {w.dtype} {tuple(w.shape)}")
    for arg, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (cache.dim() != 4 or cache.shape[2:] != (num_kv_heads, head_dim)
                or cache.dtype not in (dtype, FP8_KV_DTYPE) or cache.dtype != k_cache.dtype):
            raise ValueError(f"{name}: {arg} must be {dtype} or {FP8_KV_DTYPE} [num_blocks, block_size, "
                             f"{num_kv_heads}, {head_dim}], got {cache.dtype} {tuple(cache.shape)}")
        if not cache.is_contiguous():
            raise ValueError(f"{name}: {arg} must be contiguous")
    check_kv_scale(k_cache, kv_scale)
    if kv_scale is not None and (kv_scale.device != k_cache.device or not kv_scale.is_contiguous()):
        raise ValueError(f"{name}: kv_scale must be contiguous on the cache's device {k_cache.device}")


def qk_norm_rope_store(qkv: torch.Tensor | UnscaledRows, positions: torch.Tensor, cos_sin: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       num_heads: int, num_kv_heads: int, head_dim: int,
                       kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The attention prologue in one kernel. qkv [T, (Hq + 2 * Hkv) * D] is the packed projection
    output (row stride free, unit last stride). Per token: q and k heads get RMSNorm with q_weight /
    k_weight (both None: no qk-norm), then rotate-half RoPE at positions[t] (cos_sin [max_pos, D] float32,
    cos | sin); k and v are written to the cache [num_blocks, block_size, Hkv, D] at
    slot_mapping[t] (slots < 0 are skipped), quantized with `kv_scale` into an FP8 cache. Returns q as a
    new contiguous [T, Hq, D]. qkv may be an FP8 product before its scales (`quant/fp8.UnscaledRows`): the
    kernel scales it as it loads it, with the results of the scaled tensor."""
    unscaled = qkv if isinstance(qkv, UnscaledRows) else None
    if unscaled is not None:
        qkv = unscaled.raw
    dtype = qkv.dtype if unscaled is None else unscaled.dtype
    check_prologue_inputs("qk_norm_rope_store", qkv, positions, cos_sin, q_weight, k_weight, k_cache,
                          v_cache, slot_mapping, num_heads, num_kv_heads, head_dim, kv_scale, dtype=dtype)
    num_tokens = qkv.shape[0]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    has_norm = q_weight is not None
    half = head_dim // 2
    pdl_on = pdl.enabled(qkv.device)
    _qk_norm_rope_store_kernel[(num_tokens,)](
        qkv, positions, cos_sin, q_weight if has_norm else cos_sin, k_weight if has_norm else cos_sin,
        eps, q, k_cache, v_cache, slot_mapping, kv_scale if kv_scale is not None else cos_sin,
        *((unscaled.row_scale, unscaled.col_scale) if unscaled is not None else (cos_sin, cos_sin)),
        qkv.stride(0), cos_sin.stride(0),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), HAS_NORM=has_norm, FP8=kv_scale is not None,
        UNSCALED=unscaled is not None, DTYPE=_TL_DTYPES[dtype], PDL=pdl_on,
        num_warps=8 if num_heads * head_dim >= 8192 else 4, launch_pdl=pdl_on)
    return q
