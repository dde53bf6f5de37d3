"""What the Triton attention kernels share: the prefill kernel and the decode-rows kernel beside it
(`paged_attention.py`, `decode_rows.py`) and the one-kernel decode (`decode_attention.py`). Their input checks,
the SMs their split counts plan for, the online-softmax step over a tile of cached positions, the pages of a
tile, a decode query's splits and their merge, and the output as they write it (`out_rows`).

Reference: `tokenmill.layers.attention.paged_attention_torch`. The cache layout [num_blocks, block_size,
num_kv_heads, head_dim] and the -1 padding slot are defined in attention.py, the causal rule in
attention_metadata.py.

Every kernel reaches the cache token by token through the block table (page = block_table[n // block_size]),
so any block size works, including 1, and a tile of BLOCK_N tokens may span several pages.
Softmax runs in float32 in the log2 domain (scores are pre-multiplied by scale * log2(e)); a soft cap (Gemma
2's) is applied to those scores as to the natural ones (`softcap_scores`).
An FP8 cache (attention.py) is read as E4M3 and widened (exactly) to q's dtype for the products, float16
for a bfloat16 q (`kv_fp8.fp8_kv_operand`); K's scale is folded into the score scale, and V is widened
by `kv_fp8.fp8_v_tile`, its scale applied to the output, or, for an FP8 o_proj, the output written in
E4M3 in units of it (`out_rows`).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from tokenmill.layers.attention import FP8_KV_DTYPE, check_kv_scale
from tokenmill.layers.kernels.fused_ops import FP8_MAX
from tokenmill.layers.kernels.kv_fp8 import fp8_v_tile
from tokenmill.quant.fp8 import FP8, Fp8Rows

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
                         f"{tuple(v_cache.shape)} {v_cache.dtype} must match")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if k_cache.dtype not in _DTYPES + (FP8_KV_DTYPE,):
        raise TypeError(f"unsupported cache dtype {k_cache.dtype}; supported: {_DTYPES + (FP8_KV_DTYPE,)}")


@lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def planned_sms(device: torch.device) -> int:
    """The SMs the attention kernels' split counts plan for; the CPU interpreter plays a GPU of 8."""
    return num_sms(device.index or 0) if device.type == "cuda" else 8


def window_tiles(max_blocks_per_seq: int, block_size: int, block_n: int, window: int | None) -> int:
    """The block_n tiles a decode query's loop may visit: those of the longest possible context, or with a
    sliding window at most those of the window and the tile its first position starts in
    (`decode_splits`). A decode kernel's split count never exceeds it (CUDA-graph safe: shapes alone)."""
    tiles = triton.cdiv(max_blocks_per_seq * block_size, block_n)
    return tiles if window is None else min(tiles, triton.cdiv(window + block_n - 1, block_n))


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def check_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 [B, max_blocks] with unit inner stride, got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)} strides {block_tables.stride()}")
    if seq_lens.shape != (block_tables.shape[0],) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{block_tables.shape[0]}], got "
                         f"{seq_lens.dtype} {tuple(seq_lens.shape)}")
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")


def check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, kv_scale=None) -> None:
    _check_cache(k_cache, v_cache)
    check_kv_scale(k_cache, kv_scale)
    _, _, num_kv_heads, head_dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"q must be [T, Hq, {head_dim}] with Hq a multiple of {num_kv_heads} kv heads, "
                         f"got {tuple(q.shape)}")
    if q.stride(2) != 1:
        raise ValueError(f"q needs a unit stride on head_dim, got strides {q.stride()}")
    if k_cache.dtype not in (q.dtype, FP8_KV_DTYPE):
        raise TypeError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    check_tables(block_tables, seq_lens)
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, kv_scale) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")


def out_rows(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, kv_scale: torch.Tensor | None,
             group: int | None):
    """The attention output [T, Hq, D] and what the kernels write it as: in `dtype`, or, with an FP8 cache
    and `group` (the columns a scale of the FP8 product that takes it), in E4M3 at V's scale with that
    scale for every group of every row (an attention output is a convex combination of V's rows, so it
    stays within +-448 x V's scale). Returns (out, its scales [T, ceil(Hq * D / group)] or a stand-in,
    the kernels' constexprs for it (OUT_FP8, OUT_SCALES, BLOCK_S), and the function that gives the caller
    the finished output: the tensor, or `Fp8Rows` [T, Hq * D] of the rows' dtype `dtype`)."""
    if group is None:
        out = torch.empty(shape, dtype=dtype, device=device)
        return out, out, dict(OUT_FP8=False, OUT_SCALES=1, BLOCK_S=1), lambda o: o
    if kv_scale is None:
        raise ValueError("an FP8 attention output is at V's scale: it needs an FP8 KV cache")
    t, width = shape[0], shape[1] * shape[2]
    out = torch.empty(shape, dtype=FP8, device=device)
    scales = triton.cdiv(width, group)
    scale = torch.empty(t, scales, dtype=torch.float32, device=device)
    launch = dict(OUT_FP8=True, OUT_SCALES=scales, BLOCK_S=triton.next_power_of_2(scales))
    return out, scale, launch, lambda o: Fp8Rows(o.view(t, width), scale, group, dtype)


@triton.jit
def softcap_scores(s, SOFTCAP: tl.constexpr):
    # scores in the log2 domain (q.k x scale x log2(e)) soft-capped as transformers caps the natural ones,
    # x -> SOFTCAP tanh(x / SOFTCAP): with c = SOFTCAP log2(e) that is s -> c tanh(s / c), and tanh(s / c) =
    # 1 - 2 / (exp2(2 s / SOFTCAP) + 1), which is -1 or 1 where exp2 underflows or overflows (never NaN).
    # SOFTCAP 0: none, the scores as they are (the kernels of a model without a cap compile as before)
    if SOFTCAP > 0:
        s = (SOFTCAP * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp2(s * (2.0 / SOFTCAP)) + 1.0))
    return s


@triton.jit
def attend_tile(q, k_cache_ptr, v_cache_ptr, kv_off, kv_mask, visible, m_i, l_i, acc, scale_log2,
                DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, FP8: tl.constexpr, WIDEN_ASM: tl.constexpr,
                EMPTY_ROWS: tl.constexpr, SOFTCAP: tl.constexpr):
    # one online-softmax step over a tile of cached positions: K and V at kv_off (loads masked by kv_mask),
    # widened to q's dtype (`fp8_v_tile`: V unscaled), the scores soft-capped (`softcap_scores`); with
    # MASKED, scores outside `visible` are dropped. EMPTY_ROWS: a row may have seen no visible position yet
    # (a sliding window's first tiles), so its running max is still -inf: it is taken as 0, which makes its
    # alpha and p 0 instead of NaN
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
    s = softcap_scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2, SOFTCAP)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if EMPTY_ROWS:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = fp8_v_tile(tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0), q.dtype, FP8, WIDEN_ASM)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def merge_splits(part_out_ptr, part_lse_ptr, out_row_ptr, b64, kvh, num_active, NUM_Q_HEADS: tl.constexpr,
                 num_splits, GROUP: tl.constexpr, BLOCK_GR: tl.constexpr,
                 SPLIT_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 OUT_FP8: tl.constexpr):
    # the partial results of (b64, kvh)'s num_active splits, merged into the output row at out_row_ptr
    # (its q heads contiguous, head_dim apart): the group's heads x SPLIT_CHUNK splits x head_dim per
    # load, splits in order, so the result does not depend on which program merges; every active split
    # holds at least one position, so every lse read is finite. OUT_FP8: the partials are in units of V's
    # scale and the row is E4M3 (`store_out`)
    g = tl.arange(0, BLOCK_GR)
    g_mask = g < GROUP
    heads = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    rows = (b64 * NUM_Q_HEADS + heads) * num_splits
    m = tl.full([BLOCK_GR], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_GR], tl.float32)
    o = tl.zeros([BLOCK_GR, BLOCK_D], tl.float32)
    for s0 in range(0, num_active, SPLIT_CHUNK):
        sp = s0 + tl.arange(0, SPLIT_CHUNK)
        idx = rows[:, None] + sp[None, :]
        mask = g_mask[:, None] & (sp < num_active)[None, :]
        lse = tl.load(part_lse_ptr + idx, mask=mask, other=float("-inf"), cache_modifier=".cg")
        lse = tl.where(g_mask[:, None], lse, 0.0)  # padding heads: finite, never stored
        o_s = tl.load(part_out_ptr + idx[:, :, None] * HEAD_DIM + d[None, None, :],
                      mask=mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new[:, None])
        w_sum = w_sum * alpha + tl.sum(w, 1)
        o = o * alpha[:, None] + tl.sum(o_s * w[:, :, None], 1)
        m = m_new
    dst = out_row_ptr + heads[:, None] * HEAD_DIM + d[None, :]
    store_out(dst, o / w_sum[:, None], g_mask[:, None] & d_mask[None, :], OUT_FP8)


@triton.jit
def out_unit(v_scale, OUT_FP8: tl.constexpr):
    # what the softmax-normalised sum of V's stored values is multiplied by: V's scale, or 1 for an
    # output in units of it (OUT_FP8)
    if OUT_FP8:
        return 1.0
    else:
        return v_scale


@triton.jit
def store_out(dst, out, mask, OUT_FP8: tl.constexpr):
    # an attention output tile (float32) into the output's dtype; OUT_FP8: out is in units of V's scale,
    # within +-448 (a convex combination of V's E4M3 values) but for rounding, which the clamp takes
    if OUT_FP8:
        out = tl.clamp(out, -FP8_MAX, FP8_MAX)
    tl.store(dst, out.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def store_out_scales(scale_ptr, rows, row_mask, v_scale, SCALES: tl.constexpr, BLOCK_S: tl.constexpr):
    # the FP8 output rows' scales [T, SCALES] (rows: int64 [R]): V's scale for every group of every row
    j = tl.arange(0, BLOCK_S)
    vals = tl.zeros_like(rows).to(tl.float32)[:, None] + tl.zeros([BLOCK_S], tl.float32)[None, :] + v_scale
    tl.store(scale_ptr + rows[:, None] * SCALES + j[None, :], vals, mask=row_mask[:, None] & (j < SCALES)[None, :])


@triton.jit
def store_row_scales(scale_ptr, row64, writer, v_scale, OUT_FP8: tl.constexpr, SCALES: tl.constexpr,
                     BLOCK_S: tl.constexpr):
    # a decode program's share of its row's FP8 output scales: V's, written by the one program (`writer`)
    # of the row's kv heads and splits that is sure to run
    if OUT_FP8:
        if writer:
            one = row64 + tl.arange(0, 1)
            store_out_scales(scale_ptr, one, one >= 0, v_scale, SCALES, BLOCK_S)


@triton.jit
def decode_splits(ctx, num_splits, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr):
    # A decode query at position ctx - 1, its positions cut into splits of split_len (whole BLOCK_N tiles, at
    # least MIN_SPLIT_LEN positions), of which the first num_active hold positions; split s starts at
    # lo + s * split_len. With a sliding WINDOW (0: none) it sees the positions from `first` = ctx - WINDOW on
    # (transformers' window: p - WINDOW < j <= p), and lo is the start of the tile that holds max(first, 0), so
    # a context longer than the window costs the window's tiles alone; without one, first = lo = 0
    if WINDOW > 0:
        first = ctx - WINDOW
        lo = (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N
        span = ctx - lo
    else:
        first = 0
        lo = 0
        span = ctx
    split_len = tl.maximum(tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT_LEN)
    num_active = tl.maximum(tl.cdiv(span, split_len), 1)
    return first, lo, split_len, num_active


@triton.jit
def tile_pages(table, n0, end, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # the cache pages of positions n0 .. n0 + BLOCK_N (0 from `end` on). The attention loops load each
    # tile's pages a tile ahead of its K and V: no load of a tile then waits for another of the same tile,
    # and the software pipeliner keeps num_stages - 1 tiles of K and V in flight (with the pages loaded
    # in the same iteration it kept one, whatever the stage count)
    n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(table + n // PAGE_SIZE, mask=n < end, other=0)
