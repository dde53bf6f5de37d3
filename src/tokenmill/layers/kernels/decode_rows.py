"""A mixed step's decode rows: the sequences of one query beside the prefill chunks of a step
(`paged_attention.paged_prefill_attention`), a program per (sequence, kv head, split) for the kv head's whole
group of q heads, so a decode row's K/V is read once per kv head and its tiles have the group's rows, not the
prefill kernel's BLOCK_M. Conventions (the cache, the log2-domain softmax, FP8) as in `attention_common.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.kernel_config import DecodeAttentionConfig, shipped_decode_attention
from tokenmill.layers.kernels import pdl
from tokenmill.layers.kernels.attention_common import (LOG2E, attend_tile, decode_splits, dot_precision,
                                                       merge_splits, out_unit, planned_sms, store_out,
                                                       store_row_scales, tile_pages, window_tiles)
from tokenmill.layers.kernels.counters import zeroed as zeroed_counters
from tokenmill.layers.kernels.kv_fp8 import fp8_kv_operand, load_kv_scales

ROWS_WAVES = 16
ROWS_MAX_SPLITS = 16


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
    return max(1, min((ROWS_WAVES * planned_sms(device)) // (batch * num_kv_heads), max_tiles, ROWS_MAX_SPLITS))


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
                        WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, PDL: tl.constexpr):
    # One program: sequence b, kv head kvh and split, when b has a single query (at position ctx - 1, so
    # every cached position is visible, or with a sliding WINDOW (0: none) those from ctx - WINDOW on);
    # other sequences' programs exit. SOFTCAP (0: none): the scores' soft cap (`softcap_scores`). The
    # group's GROUP q heads are padded to BLOCK_G rows (>= 16 for tl.dot). Splits as in the one-kernel decode
    # (decode_attention.py): at least MIN_SPLIT_LEN positions each, only those holding positions run, and the
    # last of a (b, kvh) to finish merges the partial results. The prefill kernel after it may start at once
    # (`pdl.release`): it shares nothing with these rows.
    pdl.release(PDL)
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
            # each tile's pages are loaded a tile ahead of its K and V (see `tile_pages`)
            pages = tile_pages(table, start, end, PAGE_SIZE, BLOCK_N)
            for n0 in range(start, end, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                valid = n < end
                if WINDOW > 0:
                    valid = valid & (n >= first)
                off = pages.to(tl.int64) * c_stride_blk + (n % PAGE_SIZE) * c_stride_tok + kvh * c_stride_h
                pages = tile_pages(table, n0 + BLOCK_N, end, PAGE_SIZE, BLOCK_N)
                # every tile holds a visible position (the first visible one is in split 0's first)
                m_i, l_i, acc = attend_tile(q, k_cache_ptr, v_cache_ptr, off[:, None] + d[None, :],
                                            valid[:, None] & d_mask[None, :], valid[None, :], m_i, l_i, acc,
                                            scale_log2, DOT_PRECISION, True, FP8, WIDEN_ASM, False, SOFTCAP)
            has = l_i > 0
            # OUT_FP8: the output in units of V's scale (the row's scale, written by kv head 0's first split)
            acc = acc * (out_unit(v_scale, OUT_FP8) / tl.where(has, l_i, 1.0))[:, None]
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
                    merge_splits(part_out_ptr, part_lse_ptr, out_row, b64, kvh, num_active, NUM_Q_HEADS,
                                 num_splits, GROUP, BLOCK_GR, SPLIT_CHUNK, HEAD_DIM, BLOCK_D, OUT_FP8)
                    tl.store(counter, 0)  # every split has counted: nothing else touches it in this launch


def launch_decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, out: torch.Tensor,
                       out_scale: torch.Tensor, out_launch: dict, kv_scale: torch.Tensor | None,
                       config: DecodeAttentionConfig | None, num_splits: int | None, window: int | None,
                       softcap: float | None) -> None:
    """The decode-rows kernel over inputs `paged_attention.paged_prefill_attention` checked: writes the rows of
    the sequences of one query into `out` (and their scales into `out_scale`, as `out_rows` made them and its
    constexprs `out_launch`), leaving the other sequences' rows to the prefill kernel. `config`: block_n,
    num_warps, num_stages (None: the shipped launch for the cache); `num_splits` (None: from shapes,
    `decode_rows_num_splits`); `window` and `softcap` as the prefill kernel's."""
    batch = block_tables.shape[0]
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    fp8 = kv_scale is not None
    dcfg = config or shipped_decode_attention(fp8)
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
        kv_scale if fp8 else seq_lens, scale * LOG2E, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), num_splits,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, SPLIT_CHUNK=8,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_GR=triton.next_power_of_2(group),
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE_SIZE=block_size,
        BLOCK_N=dcfg.block_n, MIN_SPLIT_LEN=dcfg.min_split_len, DOT_PRECISION=dot_precision(q.dtype), FP8=fp8,
        WIDEN_ASM=q.is_cuda, **out_launch, WINDOW=window or 0, SOFTCAP=float(softcap or 0.0),
        PDL=pdl.enabled(q.device), num_warps=dcfg.num_warps, num_stages=dcfg.num_stages, maxnreg=dcfg.rows_maxnreg)
