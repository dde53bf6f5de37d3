"""Triton paged attention of a step with prefill chunks: varlen (chunked) prefill over the paged cache, with
the decode rows beside its chunks run by their own kernel (`decode_rows.py`); pure-decode steps run
`decode_attention.fused_decode_attention` instead. What the kernels share, and their conventions (the cache
layout, the log2-domain softmax, FP8 caches and outputs), are in `attention_common.py`.

Reference: `tokenmill.layers.attention.paged_attention_torch`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.attention import check_softcap, check_window
from tokenmill.layers.attention_metadata import PREFILL_BLOCK_M, AttentionMetadata
from tokenmill.layers.kernel_config import DecodeAttentionConfig, PrefillAttentionConfig
from tokenmill.layers.kernels import pdl
from tokenmill.layers.kernels.attention_common import (LOG2E, attend_tile, check_attention_inputs, dot_precision,
                                                       out_rows, out_unit, store_out, store_out_scales, tile_pages)
from tokenmill.layers.kernels.decode_rows import launch_decode_rows
from tokenmill.layers.kernels.kv_fp8 import fp8_kv_operand, load_kv_scales
from tokenmill.quant.fp8 import Fp8Rows

SHIPPED = PrefillAttentionConfig()


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
                    BLOCK_S: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, PDL: tl.constexpr):
    # One program: BLOCK_M queries of sequence b, query head h; a sequence of one query is the decode-rows
    # kernel's, which runs before this one and beside it with PDL (neither reads what the other writes; the
    # wait at the end keeps the kernels after this one behind both). Query i of the sequence sits at position
    # ctx - q_len + i and sees cached positions <= its own, and with a sliding WINDOW (0: none) > its own -
    # WINDOW. SOFTCAP (0: none): the scores' soft cap.
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
            pages = tile_pages(table, lo, full_lo, PAGE_SIZE, BLOCK_N)
            for n0 in range(lo, full_lo, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                off = pages.to(tl.int64) * c_stride_blk + (n % PAGE_SIZE) * c_stride_tok + kvh * c_stride_h
                pages = tile_pages(table, n0 + BLOCK_N, full_lo, PAGE_SIZE, BLOCK_N)
                # below full_end <= first_pos + 1: the causal rule holds for every query
                m_i, l_i, acc = attend_tile(q, k_cache_ptr, v_cache_ptr, off[:, None] + d[None, :],
                                            d_mask[None, :], n[None, :] > q_pos[:, None] - WINDOW, m_i, l_i, acc,
                                            scale_log2, DOT_PRECISION, True, FP8, WIDEN_ASM, True, SOFTCAP)
        pages = tile_pages(table, full_lo, full_end, PAGE_SIZE, BLOCK_N)
        for n0 in range(full_lo, full_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            off = pages.to(tl.int64) * c_stride_blk + (n % PAGE_SIZE) * c_stride_tok + kvh * c_stride_h
            pages = tile_pages(table, n0 + BLOCK_N, full_end, PAGE_SIZE, BLOCK_N)
            m_i, l_i, acc = attend_tile(q, k_cache_ptr, v_cache_ptr, off[:, None] + d[None, :], d_mask[None, :],
                                        d_mask[None, :], m_i, l_i, acc, scale_log2, DOT_PRECISION, False,
                                        FP8, WIDEN_ASM, False, SOFTCAP)
        pages = tile_pages(table, full_end, hi, PAGE_SIZE, BLOCK_N)
        for n0 in range(full_end, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < hi
            off = pages.to(tl.int64) * c_stride_blk + (n % PAGE_SIZE) * c_stride_tok + kvh * c_stride_h
            pages = tile_pages(table, n0 + BLOCK_N, hi, PAGE_SIZE, BLOCK_N)
            visible = valid[None, :] & (n[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (n[None, :] > q_pos[:, None] - WINDOW)
            m_i, l_i, acc = attend_tile(q, k_cache_ptr, v_cache_ptr, off[:, None] + d[None, :],
                                        valid[:, None] & d_mask[None, :], visible, m_i, l_i, acc,
                                        scale_log2, DOT_PRECISION, True, FP8, WIDEN_ASM, WINDOW > 0, SOFTCAP)

        # OUT_FP8: the output in units of V's scale (the rows' scales, written by q head 0's programs)
        acc = acc * (out_unit(v_scale, OUT_FP8) / tl.where(l_i > 0, l_i, 1.0))[:, None]
        store_out(out_ptr + rows[:, None] * o_stride_t + h * o_stride_h + d[None, :], acc,
                  q_mask[:, None] & d_mask[None, :], OUT_FP8)
        if OUT_FP8:
            if h == 0:
                store_out_scales(out_scale_ptr, rows, q_mask, v_scale, OUT_SCALES, BLOCK_S)
    pdl.wait(PDL)


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
    of several queries, BLOCK_M of them by one q head a program; the decode-rows kernel (`decode_rows.py`)
    takes those of one query, a program per (sequence, kv head) for the kv head's whole group of q heads, so
    a decode row's K/V is read once per kv head and its tiles have the group's rows, not BLOCK_M
    (`decode_config`: block_n, num_warps, num_stages; by default the shipped launch for the cache;
    `num_splits`: its splits, by default from shapes). For the prefill kernel `max_query_len` (a host
    int) sizes the grid, or, when `tiles` (int32 [2, n], from `prefill_tiles` for BLOCK_M =
    PREFILL_BLOCK_M) is given, the grid has one program per tile and head, which keeps a CUDA graph
    padded to many sequences cheap. An FP8 cache comes with its `kv_scale` (attention.py); with it,
    `out_group` (the columns a scale of the FP8 product that takes the output, `fp8_gemm.input_group`)
    has the output come as `quant/fp8.Fp8Rows` [T, Hq * D] at V's scale (`out_rows`). `window`: the layer's
    sliding window (`attention.paged_attention_torch`; None: none), a constexpr of both kernels, so a model
    without one runs the kernels compiled without it; a decode row then reads the window's tiles alone.
    `softcap`: the layer's soft cap of the scores (`attention.paged_attention_torch`; None: none), a constexpr
    of both kernels likewise (0.0: none)."""
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, kv_scale)
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
    launch_decode_rows(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, out_scale, out_launch,
                       kv_scale, decode_config, num_splits, window, softcap)
    if grid is None:
        return rows(out)
    fp8 = kv_scale is not None
    pdl_on = pdl.enabled(q.device)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        tiles if tiles is not None else query_start_loc, out, out_scale, kv_scale if fp8 else seq_lens,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        tiles.stride(0) if tiles is not None else 0,
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PAGE_SIZE=block_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_PRECISION=dot_precision(q.dtype),
        USE_TILES=tiles is not None, FP8=fp8, WIDEN_ASM=q.is_cuda, **out_launch, WINDOW=window or 0,
        SOFTCAP=float(softcap or 0.0), PDL=pdl_on, num_warps=cfg.num_warps, launch_pdl=pdl_on,
        num_stages=cfg.num_stages, maxnreg=cfg.fp8_maxnreg if fp8 else None)
    return rows(out)


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
