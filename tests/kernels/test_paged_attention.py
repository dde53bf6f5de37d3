"""The prefill kernel over the paged cache (`kernels/paged_attention.py`) against `paged_attention_torch`."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import DEVICE, HALF, _gen, _paged_cache, _randn, _tol, gpu
from tokenmill.layers.attention import paged_attention_torch, store_kvcache_torch
from tokenmill.layers.attention_metadata import AttentionMetadata
from tokenmill.layers.kernel_config import DecodeAttentionConfig, PrefillAttentionConfig
from tokenmill.layers.kernels import paged_attention as pa
from tokenmill.layers.kernels.attention_common import window_tiles
from tokenmill.layers.kernels.decode_rows import decode_rows_num_splits


@pytest.mark.parametrize("group,block_size,dtype", [
    (5, 16, torch.float32), (4, 1, torch.float32), (4, 32, HALF)])
def test_prefill_varlen_with_cached_prefix(group, block_size, dtype):
    gen = _gen(3)
    num_kv_heads, head_dim = 1, 16
    q_lens = [5, 1, 23, 0, 17]
    seq_lens = [5, 40, 30, 9, 17]
    k_cache, v_cache, table = _paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    num_q_heads = group * num_kv_heads
    qkv = _randn(sum(q_lens), (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    q = qkv[:, :num_q_heads * head_dim].view(-1, num_q_heads, head_dim)  # strided view, as in the model
    ref = paged_attention_torch(q, k_cache, v_cache, table, ctx, qsl, 0.3)
    out = pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, max(q_lens), 0.3,
                                     config=PrefillAttentionConfig(16, 16, 4, 1))
    torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))


@pytest.mark.parametrize("num_splits,dtype", [(1, torch.float32), (3, torch.float32), (8, torch.float32),
                                              (4, HALF)])
def test_decode_rows_split_over_the_context(num_splits, dtype):
    """Decode rows beside prefill chunks, each row's context cut into splits (16 positions at least): a
    context shorter than one split, one that fills fewer splits than asked, one that spans them all, and a
    padding sequence. The merged rows equal the reference, and the split counters are left zeroed, so a
    second launch gives the same result."""
    gen = _gen(11)
    num_kv_heads, head_dim, group = 2, 16, 4
    q_lens = [1, 7, 1, 1, 12, 1, 0]
    seq_lens = [9, 20, 37, 150, 12, 64, 0]
    k_cache, v_cache, table = _paged_cache(seq_lens, 8, num_kv_heads, head_dim, dtype, gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = _randn(sum(q_lens), group * num_kv_heads, head_dim, dtype=dtype, gen=gen)
    ref = paged_attention_torch(q, k_cache, v_cache, table, ctx, qsl, 0.3)
    dcfg = DecodeAttentionConfig(block_n=16, num_warps=4, num_stages=1, min_split_len=16)
    for _ in range(2):
        out = pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, max(q_lens), 0.3,
                                         config=PrefillAttentionConfig(16, 16, 4, 1), decode_config=dcfg,
                                         num_splits=num_splits)
        torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))
    from tokenmill.layers.kernels import counters
    assert all(int(c.abs().sum()) == 0 for bufs in counters._kept.values() for c in bufs)


def _dense_window_attention(q, k_cache, v_cache, table, seq_lens, q_lens, scale, window, softcap=None):
    """Each query against its sequence's whole context, one position at a time: a query at position p
    weighs the keys at p - window < j <= p alone (transformers' sliding-window mask; window None: all up to
    p), its scores s soft-capped to softcap x tanh(s / softcap) when a cap is given (Gemma 2's)."""
    out, row = torch.zeros_like(q, dtype=torch.float32), 0
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    for b, (ctx, q_len) in enumerate(zip(seq_lens, q_lens)):
        pages = table[b, : -(-ctx // block_size)].long()
        k = k_cache[pages].flatten(0, 1)[:ctx].float().repeat_interleave(q.shape[1] // num_kv_heads, 1)
        v = v_cache[pages].flatten(0, 1)[:ctx].float().repeat_interleave(q.shape[1] // num_kv_heads, 1)
        for i in range(q_len):
            p = ctx - q_len + i
            lo = 0 if window is None else max(0, p - window + 1)
            scores = torch.einsum("hd,jhd->hj", q[row + i].float(), k[lo:p + 1]).mul(scale)
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            weights = scores.softmax(-1)
            out[row + i] = torch.einsum("hj,jhd->hd", weights, v[lo:p + 1])
        row += q_len
    return out.to(q.dtype)


def _windowed_batch_equals_dense(seed: int, window: int | None, softcap: float | None, dtype):
    """Prefill chunks over cached prefixes and decode rows (150 positions among them: three splits of 16-position
    tiles), the kernels against the reference and the reference against a dense computation over each whole
    context, under `window` and `softcap`; returns the reference's inputs and its output."""
    gen = _gen(seed)
    num_kv_heads, head_dim, group = 1, 16, 2
    q_lens = [5, 1, 23, 4, 1, 0]
    seq_lens = [5, 40, 30, 70, 150, 0]
    k_cache, v_cache, table = _paged_cache(seq_lens, 4, num_kv_heads, head_dim, dtype, gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = _randn(sum(q_lens), group * num_kv_heads, head_dim, dtype=dtype, gen=gen)
    dense = _dense_window_attention(q, k_cache, v_cache, table, seq_lens, q_lens, 0.3, window, softcap)
    ref = paged_attention_torch(q, k_cache, v_cache, table, ctx, qsl, 0.3, window=window, softcap=softcap)
    torch.testing.assert_close(ref, dense, rtol=_tol(dtype), atol=_tol(dtype))
    out = pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, max(q_lens), 0.3,
                                     config=PrefillAttentionConfig(16, 16, 4, 1),
                                     decode_config=DecodeAttentionConfig(block_n=16, num_warps=4, num_stages=1,
                                                                         min_split_len=16),
                                     num_splits=3, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))
    return (q, k_cache, v_cache, table, ctx, qsl), ref


@pytest.mark.parametrize("window,dtype", [(1, torch.float32), (40, HALF)])
def test_prefill_and_decode_rows_within_a_sliding_window(window, dtype):
    """A sliding window: prefill chunks over cached prefixes (tiles of 16 rows whose rows see different
    window edges, tiles where a row sees no position, and with a window of 40 a query tile at 66-69 that
    every position of 32-63 is visible to, unmasked), and decode rows split over the window's tiles alone
    (150 positions behind a window of 40: two splits of the 54 from the window's tile on). The kernels
    equal the reference, and both a dense computation over each whole context."""
    inputs, ref = _windowed_batch_equals_dense(13, window, None, dtype)
    assert not torch.allclose(paged_attention_torch(*inputs, 0.3), ref, atol=0.1)


@pytest.mark.parametrize("window,softcap,dtype", [(None, 1.0, torch.float32), (40, 2.0, HALF)])
def test_prefill_and_decode_rows_with_a_soft_cap(window, softcap, dtype):
    """Scores soft-capped before the softmax (Gemma 2's attn_logit_softcapping, on the natural scale although the
    kernels' scores are in the log2 domain): prefill chunks over cached prefixes and decode rows split over their
    context, with and without a sliding window beside the cap. The kernels equal the reference, which equals a
    dense computation; a cap of 1 or 2 on scores of q.k x 0.3 (about 1.2 apart) moves the output."""
    inputs, ref = _windowed_batch_equals_dense(17, window, softcap, dtype)
    uncapped = paged_attention_torch(*inputs, 0.3, window=window)
    assert not torch.allclose(uncapped, ref, atol=0.1)


def test_decode_rows_splits_from_shapes(monkeypatch):
    """The split counts depend on shapes only: more sequences, fewer splits; never more splits than tiles
    in the longest possible context."""
    cpu = torch.device("cpu")
    few = decode_rows_num_splits(1, 8, 256, 16, cpu, 64)
    many = decode_rows_num_splits(256, 8, 256, 16, cpu, 64)
    assert few >= many >= 1
    assert decode_rows_num_splits(1, 1, 2, 16, cpu, 64) == 1       # 32 positions: one tile
    # the one-kernel decode on an H200's 132 SMs, 8 kv heads and 8,192-position tables: eight programs an SM
    # from 5 sequences on; batch 1-4 fill the GPU twice in 64 x 4 x 3 tiles
    from tokenmill.layers.kernels import decode_attention as da
    monkeypatch.setattr(da, "planned_sms", lambda device: 132)
    splits = {b: da.decode_num_splits(b, 8, 512, 16, cpu, 64) for b in (1, 2, 4, 5, 8, 16, 32, 48, 66, 67, 256)}
    assert splits == {1: 32, 2: 17, 4: 9, 5: 26, 8: 16, 16: 8, 32: 4, 48: 2, 66: 2, 67: 1, 256: 1}
    assert [b for b in splits if da.takes_filled_launch(b, 8, splits[b], cpu)] == [5, 8, 16, 32, 48, 66]
    assert da.decode_num_splits(4, 8, 2, 16, cpu, 64) == 1        # one tile in the longest context
    # a sliding window caps both by the tiles a query visits: its own and the one its first position is in
    assert da.decode_num_splits(1, 8, 512, 16, cpu, 64, window=100) == window_tiles(512, 16, 64, 100) == 3
    assert decode_rows_num_splits(1, 1, 256, 16, cpu, 64, window=64) == 2
    assert decode_rows_num_splits(1, 1, 256, 16, cpu, 64, window=1) == 1


def test_prefill_tile_grid_equals_sequence_grid():
    """The tile-map grid of a padded CUDA-graph batch: empty padding sequences, spare tiles, a
    sequence spanning two tiles. Rows past the last sequence (padding tokens) are not attended."""
    from tokenmill.layers.attention_metadata import PREFILL_BLOCK_M, prefill_tiles
    gen = _gen(4)
    num_kv_heads, head_dim, group = 2, 16, 2
    q_lens = [5, 1, PREFILL_BLOCK_M + 6, 0, 17, 0, 0]           # the last two: padding sequences
    seq_lens = [5, 40, PREFILL_BLOCK_M + 30, 9, 17, 0, 0]
    k_cache, v_cache, table = _paged_cache(seq_lens, 8, num_kv_heads, head_dim, torch.float32, gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    tokens = sum(q_lens)
    q = _randn(tokens + 3, group * num_kv_heads, head_dim, gen=gen)  # 3 padding token rows
    tiles = torch.from_numpy(prefill_tiles(q_lens, tokens // PREFILL_BLOCK_M + len(q_lens))).to(DEVICE)
    assert tiles.shape[1] > int((tiles[1] < 1000).sum())          # spare tiles are present
    cfg = PrefillAttentionConfig(PREFILL_BLOCK_M, 16, 4, 1)
    out = pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, tokens + 3, 0.3, config=cfg,
                                     tiles=tiles)
    ref = paged_attention_torch(q[:tokens], k_cache, v_cache, table, ctx, qsl, 0.3)
    torch.testing.assert_close(out[:tokens], ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="BLOCK_M"):
        pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, tokens, 0.3,
                                   config=PrefillAttentionConfig(16, 16, 4, 1), tiles=tiles)


def test_paged_attention_dispatch_store_then_attend():
    """Full layer step through AttentionMetadata: a prefill chunk, then a decode step (both through the
    prefill kernel; pure-decode model steps take the fused decode kernel instead)."""
    gen = _gen(4)
    block_size, num_kv_heads, group, head_dim = 4, 2, 4, 16
    num_q_heads = group * num_kv_heads
    caches = [torch.zeros(12, block_size, num_kv_heads, head_dim, device=DEVICE) for _ in range(2)]
    table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 0]], dtype=torch.int32, device=DEVICE)
    for q_lens, ctx_list in (([6, 9], [6, 9]), ([1, 1], [7, 10])):
        num_tokens = sum(q_lens)
        q = _randn(num_tokens, num_q_heads, head_dim, gen=gen)
        k = _randn(num_tokens, num_kv_heads, head_dim, gen=gen)
        v = _randn(num_tokens, num_kv_heads, head_dim, gen=gen)
        positions = [p for n, c in zip(q_lens, ctx_list) for p in range(c - n, c)]
        owner = [b for b, n in enumerate(q_lens) for _ in range(n)]
        slots = torch.tensor([int(table[b, p // block_size]) * block_size + p % block_size
                              for b, p in zip(owner, positions)], device=DEVICE)
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.tensor([0, q_lens[0], num_tokens], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(ctx_list, dtype=torch.int32, device=DEVICE),
            block_tables=table, max_query_len=max(q_lens),
            # decode must not depend on host-side lengths (CUDA graphs replay it with new ones)
            max_seq_len=max(ctx_list) if max(q_lens) > 1 else -1)
        store_kvcache_torch(k, v, caches[0], caches[1], slots)
        ref = paged_attention_torch(q, caches[0], caches[1], table, meta.seq_lens,
                                    meta.query_start_loc, 0.25)
        out = pa.paged_attention(q, caches[0], caches[1], meta, 0.25)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_attention_wrappers_reject_bad_inputs():
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    ctx = torch.ones(1, dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 2 kv heads"):
        pa.paged_prefill_attention(torch.zeros(1, 3, 16, device=DEVICE), cache, cache, table, ctx, qsl, 1, 1.0)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        pa.paged_prefill_attention(torch.zeros(1, 4, 16, device=DEVICE), cache, cache, table.long(), ctx, qsl, 1,
                                   1.0)
    with pytest.raises(TypeError, match="cache dtype"):
        pa.paged_prefill_attention(torch.zeros(1, 4, 16, device=DEVICE, dtype=torch.float16), cache, cache,
                                   table, ctx, qsl, 1, 1.0)
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        pa.paged_prefill_attention(torch.zeros(1, 4, 16, device=DEVICE), cache, cache, table, ctx, qsl.long(), 1,
                                   1.0)
    with pytest.raises(ValueError, match=r"window is 0; it must be an integer >= 1"):
        pa.paged_prefill_attention(torch.zeros(1, 4, 16, device=DEVICE), cache, cache, table, ctx, qsl, 1, 1.0,
                                   window=0)
    for softcap in (0.0, -50.0, float("inf")):
        with pytest.raises(ValueError, match=rf"softcap is {softcap}; it must be a positive finite number"):
            pa.paged_prefill_attention(torch.zeros(1, 4, 16, device=DEVICE), cache, cache, table, ctx, qsl, 1, 1.0,
                                       softcap=softcap)

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (20, 4)])
def test_gpu_prefill_realistic(num_q_heads, num_kv_heads):
    gen = _gen(11)
    q_lens, seq_lens = [512, 300, 1, 512], [512, 1400, 900, 2000]
    k_cache, v_cache, table = _paged_cache(seq_lens, 16, num_kv_heads, 128, torch.bfloat16, gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = _randn(sum(q_lens), num_q_heads, 128, dtype=torch.bfloat16, gen=gen)
    ref = paged_attention_torch(q, k_cache, v_cache, table, ctx, qsl, 128 ** -0.5)
    out = pa.paged_prefill_attention(q, k_cache, v_cache, table, ctx, qsl, max(q_lens), 128 ** -0.5)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
