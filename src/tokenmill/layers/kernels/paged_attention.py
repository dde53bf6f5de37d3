"""Triton paged attention: varlen (chunked) prefill over the paged cache with the decode rows beside its
chunks, and the checks and helpers that the decode kernel (`decode_attention.py`) shares with it.

Reference: `tokenmill.layers.attention.paged_attention_torch`. The cache layout [num_blocks, block_size,
num_kv_heads, head_dim] and the -1 padding slot are defined in attention.py, the causal rule in
attention_metadata.py.

Every kernel reaches the cache token by token through the block table (page = block_table[n // block_size]),
so any block size works, including 1, and a tile of BLOCK_N tokens may span several pages.
Softmax runs in float32 in the log2 domain (scores are pre-multiplied by scale * log2(e)); a soft cap (Gemma
2's) is applied to those scores as to the natural ones (`softcap_scores`).
An FP8 cache (attention.py) is read as E4M3 and widened (exactly) to q's dtype for the products, float16
for a bfloat16 q (`fused_ops.fp8_kv_operand`); K's scale is folded into the score scale, and V is widened
by `fused_ops.fp8_v_tile`, its scale applied to the output, or, for an FP8 o_proj, the output written in
E4M3 in units of it (`out_rows`).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from tokenmill.layers.attention import FP8_KV_DTYPE, check_kv_scale, check_softcap, check_window
from tokenmill.layers.attention_metadata import PREFILL_BLOCK_M, AttentionMetadata
from tokenmill.layers.kernel_config import DecodeAttentionConfig, PrefillAttentionConfig, shipped_decode_attention
from tokenmill.layers.kernels.counters import zeroed as zeroed_counters
from tokenmill.layers.kernels.fused_ops import FP8_MAX, fp8_kv_operand, fp8_v_tile, load_kv_scales
from tokenmill.quant.fp8 import FP8, Fp8Rows

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634

SHIPPED = PrefillAttentionConfig()
ROWS_WAVES = 16
ROWS_MAX_SPLITS = 16


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
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(device: torch.device) -> int:
    """The SMs the attention kernels' split counts plan for; the CPU interpreter plays a GPU of 8."""
    return _num_sms(device.index or 0) if device.type == "cuda" else 8


def window_tiles(max_blocks_per_seq: int, block_size: int, block_n: int, window: int | None) -> int:
    """The block_n tiles a decode query's loop may visit: those of the longest possible context, or with a
    sliding window at most those of the window and the tile its first position starts in
    (`decode_splits`). A decode kernel's split count never exceeds it (CUDA-graph safe: shapes alone)."""
    tiles = triton.cdiv(max_blocks_per_seq * block_size, block_n)
    return tiles if window is None else min(tiles, triton.cdiv(window + block_n - 1, block_n))


def decode_rows_num_splits(batch: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int,
                           device: torch.device, block_n: int, window: int | None = None) -> int:
    """Splits of a mixed step's decode rows, from shapes only (CUDA-graph safe): up to ROWS_WAVES (sequence,
    kv head, split) programs an SM, never more splits than block_n tiles in the longest possible context
    (or in a sliding `window`, `window_tiles`).
    A split holds at least min_split_len positions, so short contexts run fewer programs than the grid
    has, and the rows' batch counts the prefill sequences, whose programs exit. On an H200 (8 kv heads),
    against one split: 8 at 32 rows 14-31% faster, 4 at 64 rows 0-10%, 2 at 128 rows 0-9%; 2 at 256
    rows were 0-7% slower, so 256 rows take one (docs/BENCHMARKS.md)."""
    max_tiles = window_tiles(max_blocks_per_seq, block_size, block_n, window)
    return max(1, min((ROWS_WAVES * _sms(device)) // (batch * num_kv_heads), max_tiles, ROWS_MAX_SPLITS))


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 [B, max_blocks] with unit inner stride, got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)} strides {block_tables.stride()}")
    if seq_lens.shape != (block_tables.shape[0],) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{block_tables.shape[0]}], got "
                         f"{seq_lens.dtype} {tuple(seq_lens.shape)}")
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")


def _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, kv_scale=None) -> None:
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
    _check_tables(block_tables, seq_lens)
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, kv_scale) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")


# ---------------------------------------------------------------------- decode rows beside prefill


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
def _attend_tile(q, k_cache_ptr, v_cache_ptr, kv_off, kv_mask, visible, m_i, l_i, acc, scale_log2,
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
def _merge_splits(part_out_ptr, part_lse_ptr, out_row_ptr, b64, kvh, num_active, NUM_Q_HEADS: tl.constexpr,
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
def _out_unit(v_scale, OUT_FP8: tl.constexpr):
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
def _pages(table, n0, end, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # the cache pages of positions n0 .. n0 + BLOCK_N (0 from `end` on). The attention loops load each
    # tile's pages a tile ahead of its K and V: no load of a tile then waits for another of the same tile,
    # and the software pipeliner keeps num_stages - 1 tiles of K and V in flight (with the pages loaded
    # in the same iteration it kept one, whatever the stage count)
    n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(table + n // PAGE_SIZE, mask=n < end, other=0)


# the split count changes with the batch (eager steps): it is not specialised, so one compiled variant
# serves every step
@triton.jit(do_not_specialize=["bt_stride_b", "num_splits"])
def _decode_rows_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                        out_ptr, out_scale_ptr, part_out_ptr, part_lse_ptr, counter_ptr, kv_scale_ptr, scale_log2,
                        q_stride_t, q_stride_h, c_stride_blk, c_stride_tok, c_stride_h, bt_stride_b, num_splits,
                        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                        SPLIT_CHUNK: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_GR: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, WIDEN_ASM: tl.constexpr,
                        OUT_FP8: tl.constexpr, OUT_SCALES: tl.constexpr, BLOCK_S: tl.constexpr,
                        WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    # One program: sequence b, kv head kvh and split, when b has a single query (at position ctx - 1, so
    # every cached position is visible, or with a sliding WINDOW (0: none) those from ctx - WINDOW on);
    # other sequences' programs exit. SOFTCAP (0: none): the scores' soft cap (`softcap_scores`). The
    # group's GROUP q heads are padded to BLOCK_G rows (>= 16 for tl.dot). Splits as in the one-kernel decode
    # (decode_attention.py): at least MIN_SPLIT_LEN positions each, only those holding positions run, and the
    # last of a (b, kvh) to finish merges the partial results.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(query_start_loc_ptr + b)
    if tl.load(query_start_loc_ptr + b + 1) - row == 1:
        ctx = tl.load(seq_lens_ptr + b)
        # the splits cut [lo, ctx), lo the tile of the first visible position: split 0 holds it
        first, lo, split_len, num_active = decode_splits(ctx, num_splits, WINDOW, BLOCK_N, MIN_SPLIT_LEN)
        if split < num_active:
            start = lo + split * split_len
            end = tl.minimum(start + split_len, ctx)
            b64 = b.to(tl.int64)
            table = block_tables_ptr + b64 * bt_stride_b
            g = tl.arange(0, BLOCK_G)
            d = tl.arange(0, BLOCK_D)
            g_mask = g < GROUP
            d_mask = d < HEAD_DIM
            heads = kvh * GROUP + g
            row64 = row.to(tl.int64)
            q = tl.load(q_ptr + row64 * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                        mask=g_mask[:, None] & d_mask[None, :], other=0.0)
            q = fp8_kv_operand(q, FP8)
            k_scale, v_scale = load_kv_scales(kv_scale_ptr, FP8)
            scale_log2 = scale_log2 * k_scale
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            # each tile's pages are loaded a tile ahead of its K and V (see `_pages`)
            pages = _pages(table, start, end, PAGE_SIZE, BLOCK_N)
            for n0 in range(start, end, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                valid = n < end
                if WINDOW > 0:
                    valid = valid & (n >= first)
                off = pages.to(tl.int64) * c_stride_blk + (n % PAGE_SIZE) * c_stride_tok + kvh * c_stride_h
                pages = _pages(table, n0 + BLOCK_N, end, PAGE_SIZE, BLOCK_N)
                # every tile holds a visible position (the first visible one is in split 0's first)
                m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, off[:, None] + d[None, :],
                                             valid[:, None] & d_mask[None, :], valid[None, :], m_i, l_i, acc,
                                             scale_log2, DOT_PRECISION, True, FP8, WIDEN_ASM, False, SOFTCAP)
            has = l_i > 0
            # OUT_FP8: the output in units of V's scale (the row's scale, written by kv head 0's first split)
            acc = acc * (_out_unit(v_scale, OUT_FP8) / tl.where(has, l_i, 1.0))[:, None]
            o_mask = g_mask[:, None] & d_mask[None, :]
            out_row = out_ptr + row64 * (NUM_Q_HEADS * HEAD_DIM)
            store_row_scales(out_scale_ptr, row64, (kvh == 0) & (split == 0), v_scale, OUT_FP8, OUT_SCALES,
                             BLOCK_S)
            if num_active == 1:
                store_out(out_row + heads[:, None] * HEAD_DIM + d[None, :], acc, o_mask, OUT_FP8)
            else:
                prow = (b64 * NUM_Q_HEADS + heads) * num_splits + split
                tl.store(part_out_ptr + prow[:, None] * HEAD_DIM + d[None, :], acc, mask=o_mask)
                tl.store(part_lse_ptr + prow, m_i + tl.log2(tl.where(has, l_i, 1.0)), mask=g_mask)
                # release our partials, and learn whether every other split of (b, kvh) has released its own
                counter = counter_ptr + b * NUM_KV_HEADS + kvh
                done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if done == num_active - 1:
                    _merge_splits(part_out_ptr, part_lse_ptr, out_row, b64, kvh, num_active, NUM_Q_HEADS,
                                  num_splits, GROUP, BLOCK_GR, SPLIT_CHUNK, HEAD_DIM, BLOCK_D, OUT_FP8)
                    tl.store(counter, 0)  # every split has counted: nothing else touches it in this launch


# ------------------------------------------------------------------------------------------- prefill


# the tile count and the block-table width change from step to step (eager steps size the table to their
# longest sequence): neither is specialised, so one compiled variant serves every step
@triton.jit(do_not_specialize=["bt_stride_b", "tiles_stride"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                    query_start_loc_ptr, tiles_ptr, out_ptr, out_scale_ptr, kv_scale_ptr, scale_log2,
                    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
                    c_stride_blk, c_stride_tok, c_stride_h, bt_stride_b, tiles_stride,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, USE_TILES: tl.constexpr, FP8: tl.constexpr,
                    WIDEN_ASM: tl.constexpr, OUT_FP8: tl.constexpr, OUT_SCALES: tl.constexpr,
                    BLOCK_S: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    # One program: BLOCK_M queries of sequence b, query head h; a sequence of one query is the decode-rows
    # kernel's. Query i of the sequence sits at position ctx - q_len + i and sees cached positions <= its
    # own, and with a sliding WINDOW (0: none) > its own - WINDOW. SOFTCAP (0: none): the scores' soft cap.
    # With USE_TILES, program p takes (b, m_blk) from tiles[:, p] (see `prefill_tiles`) instead of from its
    # grid coordinates.
    h = tl.program_id(1)
    if USE_TILES:
        b = tl.load(tiles_ptr + tl.program_id(0))
        m_blk = tl.load(tiles_ptr + tiles_stride + tl.program_id(0))
    else:
        m_blk = tl.program_id(0)
        b = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if (q_len > 1) & (m_blk * BLOCK_M < q_len):
        ctx = tl.load(seq_lens_ptr + b)
        kvh = h // GROUP
        i = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        q_mask = i < q_len
        d_mask = d < HEAD_DIM
        q_pos = ctx - q_len + i
        rows = (q_start + i).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * q_stride_t + h * q_stride_h + d[None, :],
                    mask=q_mask[:, None] & d_mask[None, :], other=0.0)
        q = fp8_kv_operand(q, FP8)
        k_scale, v_scale = load_kv_scales(kv_scale_ptr, FP8)
        scale_log2 = scale_log2 * k_scale

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = block_tables_ptr + b.to(tl.int64) * bt_stride_b
        first_pos = ctx - q_len + m_blk * BLOCK_M
        # tokens [full_lo, full_end) are visible to every query of the tile: no mask needed there
        full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(ctx, first_pos + BLOCK_M)
        full_lo = 0
        if WINDOW > 0:
            # the tile's first query sees from first_pos - WINDOW + 1 on, its last from last_pos - WINDOW + 1:
            # the tiles from the first's up to the one after the last's see a window edge (masked, a row
            # may see none of a tile); the rest of [lo, full_end) is in every query's window
            last_pos = hi - 1
            lo = (tl.maximum(first_pos - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
            full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(last_pos - WINDOW + 1, 0), BLOCK_N) * BLOCK_N, lo),
                                 full_end)
            pages = _pages(table, lo, full_lo, PAGE_SIZE, BLOCK_N)
            for n0 in range(lo, full_lo, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                off = pages.to(tl.int64) * c_stride_blk + (n % PAGE_SIZE) * c_stride_tok + kvh * c_stride_h
                pages = _pages(table, n0 + BLOCK_N, full_lo, PAGE_SIZE, BLOCK_N)
                # below full_end <= first_pos + 1: the causal rule holds for every query
                m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, off[:, None] + d[None, :],
                                             d_mask[None, :], n[None, :] > q_pos[:, None] - WINDOW, m_i, l_i, acc,
                                             scale_log2, DOT_PRECISION, True, FP8, WIDEN_ASM, True, SOFTCAP)
        pages = _pages(table, full_lo, full_end, PAGE_SIZE, BLOCK_N)
        for n0 in range(full_lo, full_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            off = pages.to(tl.int64) * c_stride_blk + (n % PAGE_SIZE) * c_stride_tok + kvh * c_stride_h
            pages = _pages(table, n0 + BLOCK_N, full_end, PAGE_SIZE, BLOCK_N)
            m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, off[:, None] + d[None, :], d_mask[None, :],
                                         d_mask[None, :], m_i, l_i, acc, scale_log2, DOT_PRECISION, False,
                                         FP8, WIDEN_ASM, False, SOFTCAP)
        pages = _pages(table, full_end, hi, PAGE_SIZE, BLOCK_N)
        for n0 in range(full_end, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < hi
            off = pages.to(tl.int64) * c_stride_blk + (n % PAGE_SIZE) * c_stride_tok + kvh * c_stride_h
            pages = _pages(table, n0 + BLOCK_N, hi, PAGE_SIZE, BLOCK_N)
            visible = valid[None, :] & (n[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (n[None, :] > q_pos[:, None] - WINDOW)
            m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, off[:, None] + d[None, :],
                                         valid[:, None] & d_mask[None, :], visible, m_i, l_i, acc,
                                         scale_log2, DOT_PRECISION, True, FP8, WIDEN_ASM, WINDOW > 0, SOFTCAP)

        # OUT_FP8: the output in units of V's scale (the rows' scales, written by q head 0's programs)
        acc = acc * (_out_unit(v_scale, OUT_FP8) / tl.where(l_i > 0, l_i, 1.0))[:, None]
        store_out(out_ptr + rows[:, None] * o_stride_t + h * o_stride_h + d[None, :], acc,
                  q_mask[:, None] & d_mask[None, :], OUT_FP8)
        if OUT_FP8:
            if h == 0:
                store_out_scales(out_scale_ptr, rows, q_mask, v_scale, OUT_SCALES, BLOCK_S)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                            config: PrefillAttentionConfig = SHIPPED,
                            tiles: torch.Tensor | None = None,
                            kv_scale: torch.Tensor | None = None,
                            decode_config: DecodeAttentionConfig | None = None,
                            num_splits: int | None = None, out_group: int | None = None,
                            window: int | None = None, softcap: float | None = None) -> torch.Tensor | Fp8Rows:
    """Variable-length queries over the paged cache: q [T, Hq, D] -> out [T, Hq, D]; sequence b owns
    rows query_start_loc[b]:query_start_loc[b+1]. Two kernels: the prefill kernel takes the sequences
    of several queries, BLOCK_M of them by one q head a program; the decode-rows kernel takes those of
    one query, a program per (sequence, kv head) for the kv head's whole group of q heads, so a decode
    row's K/V is read once per kv head and its tiles have the group's rows, not BLOCK_M
    (`decode_config`: block_n, num_warps, num_stages; by default the shipped launch for the cache). For the prefill kernel `max_query_len` (a host
    int) sizes the grid, or, when `tiles` (int32 [2, n], from `prefill_tiles` for BLOCK_M =
    PREFILL_BLOCK_M) is given, the grid has one program per tile and head, which keeps a CUDA graph
    padded to many sequences cheap. An FP8 cache comes with its `kv_scale` (attention.py); with it,
    `out_group` (the columns a scale of the FP8 product that takes the output, `fp8_gemm.input_group`)
    has the output come as `quant/fp8.Fp8Rows` [T, Hq * D] at V's scale (`out_rows`). `window`: the layer's
    sliding window (`attention.paged_attention_torch`; None: none), a constexpr of both kernels, so a model
    without one runs the kernels compiled without it; a decode row then reads the window's tiles alone.
    `softcap`: the layer's soft cap of the scores (`attention.paged_attention_torch`; None: none), a constexpr
    of both kernels likewise (0.0: none)."""
    _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, kv_scale)
    check_window(window)
    check_softcap(softcap)
    batch = block_tables.shape[0]
    if query_start_loc.shape != (batch + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32 [{batch + 1}], got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    if not query_start_loc.is_contiguous():
        raise ValueError("query_start_loc must be contiguous")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    cfg = config
    out, out_scale, out_launch, rows = out_rows(q.shape, q.dtype, q.device, kv_scale, out_group)
    if num_tokens == 0 or batch == 0 or max_query_len <= 0:
        return rows(out)
    if tiles is not None:
        if tiles.dim() != 2 or tiles.shape[0] != 2 or tiles.dtype != torch.int32 or tiles.stride(1) != 1:
            raise ValueError(f"tiles must be int32 [2, n] with unit inner stride, got {tiles.dtype} "
                             f"{tuple(tiles.shape)}")
        if cfg.block_m != PREFILL_BLOCK_M:
            raise ValueError(f"tiles are cut for BLOCK_M={PREFILL_BLOCK_M}, config has {cfg.block_m}")
        grid = (tiles.shape[1], num_q_heads, 1)
    elif max_query_len > 1:
        grid = (triton.cdiv(max_query_len, cfg.block_m), num_q_heads, batch)
    else:
        grid = None
    group = num_q_heads // num_kv_heads
    fp8 = kv_scale is not None
    kv_scale = kv_scale if fp8 else seq_lens
    dot_precision = _dot_precision(q.dtype)
    block_d = max(16, triton.next_power_of_2(head_dim))
    dcfg = decode_config or shipped_decode_attention(fp8)
    if num_splits is None:
        num_splits = decode_rows_num_splits(batch, num_kv_heads, block_tables.shape[1], block_size, q.device,
                                            dcfg.block_n, window)
    if num_splits > 1:
        part_out = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        counters = zeroed_counters(q.device, batch * num_kv_heads)
    else:  # float32 as above, so that one compiled variant serves every split count
        part_out = part_lse = torch.empty(1, dtype=torch.float32, device=q.device)
        counters = seq_lens
    _decode_rows_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, out_scale, part_out, part_lse, counters,
        kv_scale, scale * _LOG2E, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), num_splits,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, SPLIT_CHUNK=8,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_GR=triton.next_power_of_2(group),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=block_size, BLOCK_N=dcfg.block_n,
        MIN_SPLIT_LEN=dcfg.min_split_len, DOT_PRECISION=dot_precision, FP8=fp8, WIDEN_ASM=q.is_cuda,
        **out_launch, WINDOW=window or 0, SOFTCAP=float(softcap or 0.0), num_warps=dcfg.num_warps,
        num_stages=dcfg.num_stages,
        maxnreg=dcfg.rows_maxnreg)
    if grid is None:
        return rows(out)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        tiles if tiles is not None else query_start_loc, out, out_scale, kv_scale, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        tiles.stride(0) if tiles is not None else 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_PRECISION=dot_precision,
        USE_TILES=tiles is not None, FP8=fp8, WIDEN_ASM=q.is_cuda, **out_launch, WINDOW=window or 0,
        SOFTCAP=float(softcap or 0.0), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, maxnreg=cfg.fp8_maxnreg if fp8 else None)
    return rows(out)


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


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, config: PrefillAttentionConfig = SHIPPED,
                    kv_scale: torch.Tensor | None = None,
                    decode_config: DecodeAttentionConfig | None = None,
                    out_group: int | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor | Fp8Rows:
    """Attention of q [T, Hq, D] over the paged cache (this step's K/V already stored) -> [T, Hq, D] (or
    `Fp8Rows` with `out_group`), within the layer's sliding `window` (None: none) and with its scores'
    `softcap` (None: none): `paged_prefill_attention`,
    for steps with prefill chunks and the decode rows beside them (pure-decode steps run
    `decode_attention.fused_decode_attention` from the packed qkv instead)."""
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                   meta.query_start_loc, meta.max_query_len, scale, config, tiles=meta.prefill_tiles,
                                   kv_scale=kv_scale, decode_config=decode_config, out_group=out_group,
                                   window=window, softcap=softcap)
