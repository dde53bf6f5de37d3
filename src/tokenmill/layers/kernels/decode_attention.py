"""A decode step's attention in one kernel, from the packed qkv projection to the attention output.

Unfused, a decode step would run three short kernels per layer between the qkv and o_proj products: the
prologue (q/k norm, RoPE, KV-cache store, `attention_prologue.qk_norm_rope_store`), split-K decode attention and
the reduction of its splits. At batch 1 each of them is a few microseconds of launch, ramp-up and drain
around almost no work, 36 times a step. Here one kernel does all three:

- every program (sequence b, kv head, split) normalises and rotates its group's q heads and the new k
  from the qkv row itself (a few hundred values), so q never goes through memory;
- split 0 writes the new k and v into the cache; no program reads that slot, the program whose range
  holds the new position takes the new token from registers instead;
- each program fetches its first K/V tile before its programmatic-dependent-launch wait (`pdl.py`): the
  cache below the new token was written by earlier steps, so that read overlaps the qkv product;
- a context of up to `min_split_len` positions is one program per (b, kv head), which writes the
  output; a longer one is cut into splits of at least that many positions, each program stores its
  partial result, and the last of a (b, kv head) to finish (a counter bumped atomically, then reset)
  merges them. Short splits and a merge beat one program walking a long context: its chain of
  dependent tile reads is the step's critical path at batch 1 (docs/BENCHMARKS.md).

Numerics equal the three kernels up to summation order: q and k are rounded to the input dtype after the
norm and after RoPE as in `qk_norm_rope_store`, and softmax runs in float32 (log2 domain). With an FP8
cache the new token's k and v are quantized as they are stored and attended as stored, so it counts as
the cached tokens do; K's scale is folded into the score scale and V's multiplies the output, V widened
by `kv_fp8.fp8_v_tile`. For an FP8 o_proj the output is written in E4M3 in units of V's scale instead
(`attention_common.out_rows`), which o_proj takes as its quantized input rows.
Reference: `qk_norm_rope_store` then `paged_attention_torch` (tests/test_kernels.py). CUDA-graph safe: the
grid, the number of splits and the scratch depend on shapes only (batch size, block_tables.shape[1], head
counts), never on host copies of lengths, and the counters are a persistent zeroed buffer (`counters.py`)
that every launch leaves zeroed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.kernel_config import SHIPPED_DECODE, DecodeAttentionConfig, shipped_decode_attention
from tokenmill.layers.kernels import pdl
from tokenmill.layers.kernels.counters import zeroed as zeroed_counters
from tokenmill.layers.kernels.attention_prologue import check_prologue_inputs, norm_rope, norm_weights
from tokenmill.layers.kernels.kv_fp8 import fp8_kv_operand, fp8_v_tile, load_kv_scales, quantize_kv
from tokenmill.layers.attention import check_softcap, check_window
from tokenmill.layers.kernels.attention_common import (LOG2E, check_tables, decode_splits, dot_precision,
                                                       merge_splits, out_rows, out_unit, planned_sms, softcap_scores,
                                                       store_out, store_row_scales, tile_pages, window_tiles)
from tokenmill.quant.fp8 import Fp8Rows

MAX_SPLITS = 32
SHIPPED = SHIPPED_DECODE


def decode_num_splits(batch: int, num_kv_heads: int, max_blocks_per_seq: int, block_size: int,
                      device: torch.device, block_n: int = SHIPPED.block_n, window: int | None = None) -> int:
    """Split-K factor from shapes only, never more splits than block_n tiles in the longest possible
    context (or in a sliding `window`, `attention_common.window_tiles`) nor MAX_SPLITS. From more than a
    quarter of an SM's worth of (sequence, kv head) programs on (`takes_filled_launch`): as many splits as
    keep at most eight programs an SM, as many one-warp programs as share one (26 at 5 sequences of 8 kv
    heads on 132 SMs, 8 at 16, 2 at 48-66, one from 67 on). Fewer programs (batch 1-4 there, where
    MAX_SPLITS caps the split count; at 3 sequences the one-warp launch at 32 splits was 37% slower with an
    FP8 cache on an H200, at 4 7% faster): enough splits in the four-warp tiles to fill the GPU twice
    (docs/BENCHMARKS.md)."""
    num_sms = planned_sms(device)
    programs = batch * num_kv_heads
    max_tiles = window_tiles(max_blocks_per_seq, block_size, block_n, window)
    if _one_warp_batch(batch, num_kv_heads, device):
        wanted = (8 * num_sms) // programs
    else:
        wanted = triton.cdiv(2 * num_sms, programs)
    return max(1, min(wanted, max_tiles, MAX_SPLITS))


def _one_warp_batch(batch: int, num_kv_heads: int, device: torch.device) -> bool:
    # more than a quarter of an SM's worth of (sequence, kv head) programs: where both the split count
    # (eight programs an SM) and the launch (`filled`) change
    return 4 * batch * num_kv_heads > planned_sms(device)


def takes_filled_launch(batch: int, num_kv_heads: int, num_splits: int, device: torch.device) -> bool:
    """Whether a decode split in num_splits takes the one-warp `filled` launch: its (sequence, kv head)
    programs are more than a quarter of the SMs."""
    return num_splits > 1 and _one_warp_batch(batch, num_kv_heads, device)


@triton.jit
def _ask_l2(ptrs):
    # ask L2 for the 128-byte line of each pointer (inline assembly: GPU only); nothing waits for it
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _load_tile(k_cache_ptr, v_cache_ptr, pages, n0, first, end, kvh, c_stride_blk, c_stride_tok, dr, d_mask,
               HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               WINDOW: tl.constexpr):
    # the K and V halves of cached positions n0 .. n0 + BLOCK_N, on their `pages` (those from `end` on,
    # and with a sliding WINDOW those before `first`, masked to zero)
    n = n0 + tl.arange(0, BLOCK_N)
    valid = n < end
    if WINDOW > 0:
        valid = valid & (n >= first)
    off = pages.to(tl.int64) * c_stride_blk + (n % PAGE_SIZE) * c_stride_tok + kvh * HEAD_DIM
    off = off[:, None] + dr[None, :]
    mask = valid[:, None] & d_mask[None, :]
    k_lo = tl.load(k_cache_ptr + off, mask=mask, other=0.0)
    k_hi = tl.load(k_cache_ptr + off + HALF, mask=mask, other=0.0)
    v_lo = tl.load(v_cache_ptr + off, mask=mask, other=0.0)
    v_hi = tl.load(v_cache_ptr + off + HALF, mask=mask, other=0.0)
    return k_lo, k_hi, v_lo, v_hi, valid


@triton.jit
def _attend_tile(q1, q2, k_lo, k_hi, v_lo, v_hi, valid, m_i, l_i, acc1, acc2, scale_log2,
                 DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, WIDEN_ASM: tl.constexpr, SOFTCAP: tl.constexpr):
    # one online-softmax step over a tile of cached positions (at least one valid), heads in halves; an
    # FP8 tile is widened to q's dtype (exact; a no-op for a cache in q's dtype), unscaled; the scores
    # soft-capped (`attention_common.softcap_scores`)
    k_lo, k_hi = k_lo.to(q1.dtype), k_hi.to(q1.dtype)
    v_lo, v_hi = fp8_v_tile(v_lo, q1.dtype, FP8, WIDEN_ASM), fp8_v_tile(v_hi, q1.dtype, FP8, WIDEN_ASM)
    s = tl.dot(q1, tl.trans(k_lo), input_precision=DOT_PRECISION)
    s = softcap_scores((s + tl.dot(q2, tl.trans(k_hi), input_precision=DOT_PRECISION)) * scale_log2, SOFTCAP)
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc1 = acc1 * alpha[:, None] + tl.dot(p.to(v_lo.dtype), v_lo, input_precision=DOT_PRECISION)
    acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v_hi.dtype), v_hi, input_precision=DOT_PRECISION)
    return m_new, l_i, acc1, acc2


@triton.jit(do_not_specialize=["bt_stride_b"])   # block-table width: one variant for every step
def _fused_decode_kernel(qkv_ptr, positions_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, eps,
                         k_cache_ptr, v_cache_ptr, slot_ptr, block_tables_ptr, seq_lens_ptr,
                         out_ptr, out_scale_ptr, part_out_ptr, part_lse_ptr, counter_ptr, kv_scale_ptr, scale_log2,
                         qkv_stride_t, cs_stride, c_stride_blk, c_stride_tok, bt_stride_b,
                         NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GR: tl.constexpr,
                         SPLIT_CHUNK: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         BLOCK_N: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
                         ASK_L2: tl.constexpr, WIDEN_ASM: tl.constexpr, OUT_FP8: tl.constexpr,
                         OUT_SCALES: tl.constexpr, BLOCK_S: tl.constexpr, WINDOW: tl.constexpr,
                         SOFTCAP: tl.constexpr):
    # One program: sequence b, kv head kvh, split. Heads are 2 * HALF wide and handled as two halves,
    # the layout RoPE works in; the group's GROUP q heads are padded to BLOCK_G rows (>= 16 for tl.dot).
    # With a sliding WINDOW (0: none) the new token sees the positions from ctx - WINDOW on alone, and the
    # splits cut [lo, ctx), lo the tile of the first of them (`attention_common.decode_splits`). SOFTCAP (0:
    # none): every score's soft cap, the new token's included (`attention_common.softcap_scores`).
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b64 = b.to(tl.int64)
    # Until pdl.enter this reads only what no kernel of this forward pass writes: the step's metadata,
    # written before the pass, and the cache below the new token, written by earlier steps.
    ctx = tl.load(seq_lens_ptr + b)
    new = ctx - 1  # this step's token; ctx 0 is a padded CUDA-graph slot, which has none
    # splits of at least MIN_SPLIT_LEN positions; only the splits that hold positions run
    first, lo, split_len, num_active = decode_splits(ctx, NUM_SPLITS, WINDOW, BLOCK_N, MIN_SPLIT_LEN)
    if split < num_active:
        start = lo + split * split_len
        end = tl.minimum(start + split_len, ctx)
        cached_end = tl.minimum(end, new)  # positions before the new token are in the cache already
        pos = tl.load(positions_ptr + b).to(tl.int64)
        dr = tl.arange(0, BLOCK_HALF)
        d_mask = dr < HALF
        cos = tl.load(cos_sin_ptr + pos * cs_stride + dr[None, :], mask=d_mask[None, :], other=0.0)
        sin = tl.load(cos_sin_ptr + pos * cs_stride + HALF + dr[None, :], mask=d_mask[None, :], other=0.0)
        table = block_tables_ptr + b64 * bt_stride_b
        pages = tile_pages(table, start, cached_end, PAGE_SIZE, BLOCK_N)
        k_lo, k_hi, v_lo, v_hi, first_valid = _load_tile(k_cache_ptr, v_cache_ptr, pages, start, first,
                                                         cached_end, kvh, c_stride_blk, c_stride_tok, dr, d_mask,
                                                         HEAD_DIM, HALF, PAGE_SIZE, BLOCK_N, WINDOW)
        # the norm weights are weights, and the split counter's line is only asked into L2: both before
        # the wait, so no HBM read of theirs is left between the wait and the output
        qw1, qw2 = norm_weights(q_w_ptr, HALF, BLOCK_HALF, HAS_NORM)
        kw1, kw2 = norm_weights(k_w_ptr, HALF, BLOCK_HALF, HAS_NORM)
        k_scale, v_scale = load_kv_scales(kv_scale_ptr, FP8)
        scale_log2 = scale_log2 * k_scale
        if ASK_L2:
            _ask_l2(counter_ptr + b * NUM_KV_HEADS + kvh)
        pdl.enter(PDL)

        row = qkv_ptr + b64 * qkv_stride_t
        # the row as the qkv product wrote it, scaled (`Attention.forward`)
        q_src = row + kvh * GROUP * HEAD_DIM
        q1, q2, _ = norm_rope(q_src, qw1, qw2, eps, cos, sin, 1.0, q_src, GROUP, BLOCK_G, HALF, BLOCK_HALF, HAS_NORM,
                              False, tl.float32)
        q1, q2 = fp8_kv_operand(q1, FP8), fp8_kv_operand(q2, FP8)
        # the new k as the first of two rows (the second is masked to zero), v as loaded
        k_src = row + (NUM_Q_HEADS + kvh) * HEAD_DIM
        k1, k2, k_mask = norm_rope(k_src, kw1, kw2, eps, cos, sin, 1.0, k_src, 1, 2, HALF, BLOCK_HALF, HAS_NORM,
                                   False, tl.float32)
        v_src = row + (NUM_Q_HEADS + NUM_KV_HEADS + kvh) * HEAD_DIM
        v1 = tl.load(v_src + dr, mask=d_mask, other=0.0)
        v2 = tl.load(v_src + HALF + dr, mask=d_mask, other=0.0)
        # the new k and v as the cache holds them (E4M3 of k / scale with an FP8 cache)
        k1, k2 = quantize_kv(k1, k_scale, FP8), quantize_kv(k2, k_scale, FP8)
        v1, v2 = quantize_kv(v1, v_scale, FP8), quantize_kv(v2, v_scale, FP8)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if (split == 0) & (slot >= 0):
            dst = slot * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM
            hk = tl.arange(0, 2)[:, None]
            tl.store(k_cache_ptr + dst + hk * HEAD_DIM + dr[None, :], k1, mask=k_mask)
            tl.store(k_cache_ptr + dst + HALF + hk * HEAD_DIM + dr[None, :], k2, mask=k_mask)
            tl.store(v_cache_ptr + dst + dr, v1, mask=d_mask)
            tl.store(v_cache_ptr + dst + HALF + dr, v2, mask=d_mask)
        k1, k2 = k1.to(q1.dtype), k2.to(q1.dtype)
        v1, v2 = v1.to(q1.dtype), v2.to(q1.dtype)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc1 = tl.zeros([BLOCK_G, BLOCK_HALF], tl.float32)
        acc2 = tl.zeros([BLOCK_G, BLOCK_HALF], tl.float32)
        # the first tile when it holds a visible cached position (with a window, split 0's first tile may
        # hold none: a window of 1 sees the new token alone); every later tile does
        if WINDOW > 0:
            attend_first = tl.maximum(start, first) < cached_end
        else:
            attend_first = start < cached_end
        if attend_first:
            m_i, l_i, acc1, acc2 = _attend_tile(q1, q2, k_lo, k_hi, v_lo, v_hi, first_valid, m_i, l_i,
                                                acc1, acc2, scale_log2, DOT_PRECISION, FP8, WIDEN_ASM, SOFTCAP)
        # each tile's pages are loaded a tile ahead of its K and V (see `tile_pages`)
        pages = tile_pages(table, start + BLOCK_N, cached_end, PAGE_SIZE, BLOCK_N)
        for n0 in range(start + BLOCK_N, cached_end, BLOCK_N):
            k_lo, k_hi, v_lo, v_hi, valid = _load_tile(k_cache_ptr, v_cache_ptr, pages, n0, first, cached_end,
                                                       kvh, c_stride_blk, c_stride_tok, dr, d_mask, HEAD_DIM, HALF,
                                                       PAGE_SIZE, BLOCK_N, WINDOW)
            pages = tile_pages(table, n0 + BLOCK_N, cached_end, PAGE_SIZE, BLOCK_N)
            m_i, l_i, acc1, acc2 = _attend_tile(q1, q2, k_lo, k_hi, v_lo, v_hi, valid, m_i, l_i,
                                                acc1, acc2, scale_log2, DOT_PRECISION, FP8, WIDEN_ASM, SOFTCAP)
        if (new >= start) & (new < end):
            k1f = tl.sum(k1.to(tl.float32), 0)  # row 1 is zero
            k2f = tl.sum(k2.to(tl.float32), 0)
            s_new = tl.sum(q1.to(tl.float32) * k1f[None, :], 1) + tl.sum(q2.to(tl.float32) * k2f[None, :], 1)
            s_new = softcap_scores(s_new * scale_log2, SOFTCAP)
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p_new
            # p rounded to the cache dtype, as the cached tokens' p is for their tl.dot with V
            p_new = p_new.to(v1.dtype).to(tl.float32)
            acc1 = acc1 * alpha[:, None] + p_new[:, None] * v1.to(tl.float32)[None, :]
            acc2 = acc2 * alpha[:, None] + p_new[:, None] * v2.to(tl.float32)[None, :]
            m_i = m_new

        g = tl.arange(0, BLOCK_G)
        g_mask = g < GROUP
        heads = kvh * GROUP + g
        o_mask = g_mask[:, None] & d_mask[None, :]
        has = l_i > 0
        # V's scale (1.0 without FP8; 1.0 for an output in its units, OUT_FP8) with the softmax's sum
        inv = out_unit(v_scale, OUT_FP8) / tl.where(has, l_i, 1.0)
        store_row_scales(out_scale_ptr, b64, (kvh == 0) & (split == 0), v_scale, OUT_FP8, OUT_SCALES, BLOCK_S)
        if num_active == 1:
            dst = out_ptr + b64 * (NUM_Q_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dr[None, :]
            store_out(dst, acc1 * inv[:, None], o_mask, OUT_FP8)
            store_out(dst + HALF, acc2 * inv[:, None], o_mask, OUT_FP8)
        else:
            prow = (b64 * NUM_Q_HEADS + heads) * NUM_SPLITS + split
            part = part_out_ptr + prow[:, None] * HEAD_DIM + dr[None, :]
            tl.store(part, acc1 * inv[:, None], mask=o_mask)
            tl.store(part + HALF, acc2 * inv[:, None], mask=o_mask)
            tl.store(part_lse_ptr + prow, m_i + tl.log2(tl.where(has, l_i, 1.0)), mask=g_mask)
            # release our partials, and learn whether every other split of (b, kvh) has released its own
            counter = counter_ptr + b * NUM_KV_HEADS + kvh
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == num_active - 1:
                merge_splits(part_out_ptr, part_lse_ptr, out_ptr + b64 * (NUM_Q_HEADS * HEAD_DIM), b64, kvh,
                             num_active, NUM_Q_HEADS,
                             NUM_SPLITS, GROUP, BLOCK_GR, SPLIT_CHUNK, HEAD_DIM, BLOCK_D, OUT_FP8)
                tl.store(counter, 0)  # every split has counted: nothing else touches it in this launch


def fused_decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_heads: int, num_kv_heads: int, head_dim: int,
                           num_splits: int | None = None,
                           config: DecodeAttentionConfig | None = None,
                           kv_scale: torch.Tensor | None = None,
                           out_group: int | None = None, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor | Fp8Rows:
    """One new token per sequence: qkv row b is sequence b's packed projection [(Hq + 2 Hkv) * D], its
    token sits at position seq_lens[b] - 1 (cos/sin taken at positions[b]) and goes to the cache at
    slot_mapping[b]. Equals `qk_norm_rope_store` (same arguments) followed by attention over the cache
    (`attention.paged_attention_torch`, one query a sequence); returns the attention output [B, Hq, D].
    A sequence with seq_len 0 (a padded CUDA-graph slot, slot -1) gets zeros. An FP8 cache comes with its
    `kv_scale` (attention.py); with it, `out_group` has the output come as `Fp8Rows` [B, Hq * D] at V's
    scale (`attention_common.out_rows`). `config`: the launch, by default the shipped one for the cache's
    dtype. `window`: the layer's sliding window (None: none; a constexpr, so a model without one runs the
    kernel compiled without it): the new token attends over the window's positions alone, and only the
    window's tiles are read and split. `softcap`: the layer's soft cap of the scores (None: none; a constexpr
    likewise, 0.0 for none), as `attention.paged_attention_torch` applies it."""
    check_prologue_inputs("fused_decode_attention", qkv, positions, cos_sin, q_weight, k_weight, k_cache,
                          v_cache, slot_mapping, num_heads, num_kv_heads, head_dim, kv_scale)
    batch = qkv.shape[0]
    check_tables(block_tables, seq_lens)
    check_window(window)
    check_softcap(softcap)
    devices = {t.device for t in (qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, block_tables,
                                  seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"fused_decode_attention: all inputs must be on one device, got {devices}")
    if num_heads % num_kv_heads:
        raise ValueError(f"fused_decode_attention: {num_heads} q heads are not a multiple of "
                         f"{num_kv_heads} kv heads")
    if batch != block_tables.shape[0]:
        raise ValueError(f"fused_decode_attention needs one token per sequence: qkv has {batch} rows, "
                         f"block_tables {block_tables.shape[0]}")
    block_size = k_cache.shape[1]
    cfg = config or shipped_decode_attention(kv_scale is not None)
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, block_tables.shape[1], block_size,
                                       qkv.device, cfg.block_n, window)
    if num_splits == 1 and cfg.one_split is not None:
        cfg = cfg.one_split
    elif cfg.filled is not None and takes_filled_launch(batch, num_kv_heads, num_splits, qkv.device):
        cfg = cfg.filled
    out, out_scale, out_launch, rows = out_rows((batch, num_heads, head_dim), qkv.dtype, qkv.device, kv_scale,
                                                out_group)
    if batch == 0:
        return rows(out)
    if num_splits > 1:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=qkv.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=qkv.device)
        counters = zeroed_counters(qkv.device, batch * num_kv_heads)
    else:
        part_out = part_lse = out
        counters = seq_lens
    has_norm = q_weight is not None
    half = head_dim // 2
    group = num_heads // num_kv_heads
    pdl_on = pdl.enabled(qkv.device)
    _fused_decode_kernel[(batch, num_kv_heads, num_splits)](
        qkv, positions, cos_sin, q_weight if has_norm else cos_sin, k_weight if has_norm else cos_sin, eps,
        k_cache, v_cache, slot_mapping, block_tables, seq_lens, out, out_scale, part_out, part_lse, counters,
        kv_scale if kv_scale is not None else seq_lens, scale * LOG2E,
        qkv.stride(0), cos_sin.stride(0), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        NUM_SPLITS=num_splits,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_GR=triton.next_power_of_2(group),
        SPLIT_CHUNK=min(8, triton.next_power_of_2(num_splits)),
        HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=max(16, triton.next_power_of_2(half)),
        BLOCK_D=triton.next_power_of_2(head_dim), HAS_NORM=has_norm, PAGE_SIZE=block_size,
        BLOCK_N=cfg.block_n, MIN_SPLIT_LEN=cfg.min_split_len, DOT_PRECISION=dot_precision(qkv.dtype),
        FP8=kv_scale is not None, PDL=pdl_on, ASK_L2=qkv.is_cuda, WIDEN_ASM=qkv.is_cuda, **out_launch,
        WINDOW=window or 0, SOFTCAP=float(softcap or 0.0), num_warps=cfg.num_warps,
        launch_pdl=pdl_on,
        num_stages=cfg.many_splits_stages if num_splits >= cfg.many_splits else cfg.num_stages,
        maxnreg=cfg.maxnreg)
    return rows(out)
