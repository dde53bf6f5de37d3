"""The attention prologue after the qkv projection, in one kernel (`qk_norm_rope_store`): per token, the q and
k heads' RMSNorm (qk-norm models), rotate-half RoPE, and K and V written to the paged cache (quantized into
an FP8 cache, `kv_fp8.quantize_kv`); q returned for the attention kernels. Its per-head helpers
(`norm_weights`, `norm_rope`) and input checks (`check_prologue_inputs`) serve the one-kernel decode too
(decode_attention.py), which runs the prologue itself.

References: `rms_norm_torch` (norm.py), `apply_rotary_torch` (rotary.py), `store_kvcache_torch`
(attention.py). The kernel rounds intermediates to the input dtype where they do, so results match them
to the last bit or one rounding step. qkv needs a unit stride on the last dim only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.attention import FP8_KV_DTYPE, check_kv_scale
from tokenmill.layers.kernels import pdl
from tokenmill.layers.kernels.fused_ops import TL_DTYPES, check_dtype, scaled_load
from tokenmill.layers.kernels.kv_fp8 import load_kv_scales, quantize_kv
from tokenmill.quant.fp8 import UnscaledRows


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
    # the two halves of NUM_HEADS heads from src_ptr (heads 2 * HALF apart; `fused_ops.scaled_load`, cs_ptr the column
    # scales of src_ptr's first column), and their mask
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (d < HALF)
    x1 = scaled_load(src_ptr, cs_ptr, h * (2 * HALF) + d, mask, rs, UNSCALED, DTYPE)
    x2 = scaled_load(src_ptr, cs_ptr, h * (2 * HALF) + HALF + d, mask, rs, UNSCALED, DTYPE)
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
    check_dtype(f"{name} qkv", qkv)
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
        UNSCALED=unscaled is not None, DTYPE=TL_DTYPES[dtype], PDL=pdl_on,
        num_warps=8 if num_heads * head_dim >= 8192 else 4, launch_pdl=pdl_on)
    return q
