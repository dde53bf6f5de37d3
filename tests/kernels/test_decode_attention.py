"""Decode attention in one kernel (`kernels/decode_attention.py`) against the prologue, then
`paged_attention_torch`."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import DEVICE, gpu, HALF, _gen, _paged_cache, _prologue_reference, _randn, _tol
from tokenmill.layers.attention import paged_attention_torch
from tokenmill.layers.kernel_config import DecodeAttentionConfig
from tokenmill.layers.kernels import decode_attention as da
from tokenmill.layers.rotary import RotaryEmbedding


def _decode_positions(table, ctx, block_size):
    """Each sequence's new token: position ctx - 1 and its cache slot; slot -1 for ctx 0 (padding)."""
    positions = (ctx - 1).clamp(min=0).long()
    pages = table.long().gather(1, (positions // block_size)[:, None])[:, 0]
    return positions, torch.where(ctx > 0, pages * block_size + positions % block_size, -1)


def _fused_decode_reference(qkv, positions, cos_sin, q_weight, k_weight, k_cache, v_cache, slots, table,
                            ctx, num_heads, num_kv_heads, head_dim, window=None, softcap=None):
    """The unfused decode attention on copies of the cache: prologue (norm, RoPE, store), then attention
    over the cache (within `window`, the scores soft-capped by `softcap`). Returns (out, k_cache, v_cache)."""
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q = _prologue_reference(qkv, positions, cos_sin, q_weight, k_weight, 1e-6, ref_k, ref_v, slots,
                            num_heads, num_kv_heads, head_dim)
    qsl = torch.arange(qkv.shape[0] + 1, dtype=torch.int32, device=DEVICE)
    return (paged_attention_torch(q, ref_k, ref_v, table, ctx, qsl, head_dim ** -0.5, window=window, softcap=softcap),
            ref_k, ref_v)


def _check_fused_decode(gen, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm,
                        num_splits, config, tol, window=None, softcap=None):
    """The one-kernel decode attention against the unfused reference. Context length 0 is a padded
    slot (slot -1, zero output)."""
    batch = len(seq_lens)
    k_cache, v_cache, table = _paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    positions, slots = _decode_positions(table, ctx, block_size)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0).to(DEVICE)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn(batch, width + 8, dtype=dtype, gen=gen)[:, 5:5 + width]  # row stride != width
    q_weight = _randn(head_dim, dtype=dtype, gen=gen) if qk_norm else None
    k_weight = _randn(head_dim, dtype=dtype, gen=gen) if qk_norm else None
    ref, ref_k, ref_v = _fused_decode_reference(qkv, positions, rope.cos_sin, q_weight, k_weight, k_cache,
                                                v_cache, slots, table, ctx, num_heads, num_kv_heads, head_dim,
                                                window, softcap)
    for _ in range(2):  # the second launch finds the split counters reset by the first
        out = da.fused_decode_attention(qkv, positions, rope.cos_sin, q_weight, k_weight, 1e-6, k_cache,
                                        v_cache, slots, table, ctx, head_dim ** -0.5, num_heads,
                                        num_kv_heads, head_dim, num_splits=num_splits,
                                        config=config or da.SHIPPED, window=window, softcap=softcap)
        assert out.shape == (batch, num_heads, head_dim)
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(k_cache, ref_k, rtol=tol, atol=tol)
    assert torch.equal(v_cache, ref_v)
    from tokenmill.layers.kernels import counters
    assert all(int(c.abs().sum()) == 0 for bufs in counters._kept.values() for c in bufs)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,qk_norm,num_splits,min_split", [
    (4, 2, 16, 4, torch.float32, True, 1, 16),
    (4, 2, 32, 16, HALF, True, 3, 16),
    (5, 1, 32, 1, torch.float32, False, 4, 16),
    (8, 2, 16, 4, HALF, False, None, 16),
    (4, 1, 16, 4, torch.float32, True, 4, 32),
    (4, 1, 16, 16, torch.float32, True, 16, 16),
])
def test_fused_decode_attention_equals_prologue_then_attention(num_heads, num_kv_heads, head_dim, block_size,
                                                                dtype, qk_norm, num_splits, min_split):
    # one split or several of >= min_split positions (merged in the kernel, 10 splits in two chunks of 8
    # at most); the new token first, last and inside a split, alone, and in a split of its own
    _check_fused_decode(_gen(31), [1, 37, 0, 16, 70, 33, 150], num_heads, num_kv_heads, head_dim, block_size,
                        dtype, qk_norm, num_splits, DecodeAttentionConfig(16, min_split_len=min_split), _tol(dtype))


@pytest.mark.parametrize("window,num_splits", [(1, 1), (20, 4)])
def test_fused_decode_attention_within_a_sliding_window(window, num_splits):
    """The new token sees the window's positions alone (a window of 1: itself): contexts shorter than the
    window, ones whose window starts inside a tile, splits over the window's tiles from that one on (150
    positions behind a window of 20: 6 in the first tile, two splits), and a padded slot."""
    _check_fused_decode(_gen(32), [1, 0, 16, 37, 150], 4, 1, 16, 4, torch.float32, True, num_splits,
                        DecodeAttentionConfig(16, min_split_len=16), _tol(torch.float32), window)


@pytest.mark.parametrize("window", [None, 20])
def test_fused_decode_attention_with_a_soft_cap(window):
    """Every score soft-capped before the softmax (a cap of 0.5 on q.k / 4 of unit-normal heads of 16, which it
    bites), the new token's (taken from registers) as the cached ones', over splits and within a sliding window."""
    _check_fused_decode(_gen(34), [1, 0, 16, 37, 150], 4, 1, 16, 4, torch.float32, True, 4,
                        DecodeAttentionConfig(16, min_split_len=16), _tol(torch.float32), window, softcap=0.5)


def test_fused_decode_attention_stages_follow_the_split_count(monkeypatch):
    """A launch with `many_splits` splits (the most there are, at batch 1) runs its tile loop without
    software pipelining (one stage); one with fewer keeps the configured stages. Both stay correct."""
    kernel, stages = da._fused_decode_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                stages.append(kwargs["num_stages"])
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(da, "_fused_decode_kernel", Recorder())
    config = DecodeAttentionConfig(16, min_split_len=16)
    for num_splits, want in ((da.SHIPPED.many_splits, da.SHIPPED.many_splits_stages),
                             (4, da.SHIPPED.num_stages)):
        stages.clear()
        _check_fused_decode(_gen(33), [1, 70, 150], 4, 1, 16, 16, torch.float32, True, num_splits, config,
                            _tol(torch.float32))
        assert stages == [want, want]
    assert da.SHIPPED.many_splits_stages != da.SHIPPED.num_stages


def test_fused_decode_attention_takes_the_launch_of_its_split(monkeypatch):
    """A configuration with `one_split` and `filled` launches the first where every program takes a whole
    context (one split), the second where more than a quarter of the SMs' worth of (sequence, kv head)
    programs are split (the interpreter plays 8 SMs), and its own tiles where fewer are; all correct."""
    kernel, launches = da._fused_decode_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((kwargs["BLOCK_N"], kwargs["num_warps"]))
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(da, "_fused_decode_kernel", Recorder())
    config = DecodeAttentionConfig(32, min_split_len=32,
                                   one_split=DecodeAttentionConfig(16, num_warps=1, min_split_len=16),
                                   filled=DecodeAttentionConfig(16, num_warps=2, min_split_len=16))
    few, more = [70, 150], [1, 70, 150]                 # 2 and 3 programs over one kv head
    for seq_lens, num_kv_heads, num_splits, want in ((few, 1, 1, (16, 1)), (few, 1, 3, (32, 4)),
                                                     (few, 1, 11, (32, 4)), (more, 1, 3, (16, 2)),
                                                     (more, 1, 1, (16, 1))):
        launches.clear()
        _check_fused_decode(_gen(34), seq_lens, 4, num_kv_heads, 16, 16, torch.float32, True, num_splits, config,
                            _tol(torch.float32))
        assert launches == [want, want]


def test_fused_decode_attention_rejects_bad_inputs():
    rope = RotaryEmbedding(16, 8, 10000.0).to(DEVICE)
    qkv = torch.zeros(2, (4 + 2 * 2) * 16, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    slots = torch.arange(2, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    table = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    ctx = torch.ones(2, dtype=torch.int32, device=DEVICE)

    def call(qkv=qkv, positions=positions, slots=slots, table=table, ctx=ctx, heads=(4, 2)):
        da.fused_decode_attention(qkv, positions, rope.cos_sin, None, None, 1e-6, cache, cache, slots, table,
                                  ctx, 0.25, *heads, 16)

    with pytest.raises(ValueError, match=r"fused_decode_attention: qkv must be \[T, 112\]"):
        call(heads=(3, 2))
    with pytest.raises(ValueError, match=r"one token per sequence: qkv has 1 rows, block_tables 2"):
        call(qkv=qkv[:1], positions=positions[:1], slots=slots[:1])
    with pytest.raises(ValueError, match=r"seq_lens must be int32 \[2\]"):
        call(ctx=ctx.long())
    with pytest.raises(ValueError, match=r"block_tables must be int32"):
        call(table=table.long())

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (20, 4)])
@pytest.mark.parametrize("batch", [1, 33])
def test_gpu_fused_decode_realistic(num_q_heads, num_kv_heads, batch):
    gen = _gen(16)
    seq_lens = torch.randint(1, 2100, (batch,), generator=gen).tolist()
    _check_fused_decode(gen, seq_lens, num_q_heads, num_kv_heads, 128, 16, torch.bfloat16,
                        num_q_heads == 32, None, None, 2e-2)


@pytest.mark.gpu
@gpu
def test_gpu_fused_decode_cuda_graph_replay_with_new_lengths():
    """Captured once, replayed with new lengths, slots and inputs: the split merge, its counters and the
    cache store all follow the device tensors."""
    gen = _gen(17)
    bf16, batch, hq, hkv = torch.bfloat16, 4, 32, 8
    k_cache, v_cache, table = _paged_cache([600] * batch, 16, hkv, 128, bf16, gen)
    rope = RotaryEmbedding(128, 4096, 1e6).to(DEVICE)
    qkv = _randn(batch, (hq + 2 * hkv) * 128, dtype=bf16, gen=gen)
    q_weight, k_weight = _randn(128, dtype=bf16, gen=gen), _randn(128, dtype=bf16, gen=gen)
    ctx = torch.full((batch,), 3, dtype=torch.int32, device=DEVICE)
    positions, slots = _decode_positions(table, ctx, 16)

    def step():
        return da.fused_decode_attention(qkv, positions, rope.cos_sin, q_weight, k_weight, 1e-6, k_cache,
                                         v_cache, slots, table, ctx, 128 ** -0.5, hq, hkv, 128)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ([1, 600, 17, 333], [600, 2, 0, 64]):
        ctx.copy_(torch.tensor(lengths, dtype=torch.int32))
        new_positions, new_slots = _decode_positions(table, ctx, 16)
        positions.copy_(new_positions)
        slots.copy_(new_slots)
        qkv.copy_(_randn(batch, (hq + 2 * hkv) * 128, dtype=bf16, gen=gen))
        ref, ref_k, ref_v = _fused_decode_reference(qkv, positions, rope.cos_sin, q_weight, k_weight,
                                                    k_cache, v_cache, slots, table, ctx, hq, hkv, 128)
        graph.replay()
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(k_cache, ref_k, rtol=2e-2, atol=2e-2)
        assert torch.equal(v_cache, ref_v)


def test_the_backend_launches_each_caches_decode_configuration(monkeypatch):
    """The Triton backend hands the decode kernels `KernelConfig.decode_attention` with a bf16 cache and
    `fp8_decode_attention` with an FP8 one (a cache with a kv_scale), in pure-decode and mixed steps."""
    from tokenmill.layers.backend import TritonBackend
    from tokenmill.layers.kernel_config import KernelConfig
    from tokenmill.layers.kernels import paged_attention
    seen = []
    monkeypatch.setattr(da, "fused_decode_attention", lambda *a, config=None, **k: seen.append(config))
    monkeypatch.setattr(paged_attention, "paged_attention", lambda *a, decode_config=None, **k: seen.append(decode_config))
    kernels = KernelConfig(decode_attention=DecodeAttentionConfig(16, min_split_len=16),
                           fp8_decode_attention=DecodeAttentionConfig(32, min_split_len=32))
    backend = TritonBackend(kernels)

    class PureDecode:
        def is_pure_decode(self, num_tokens):
            return True
    attend = backend.decode_attention(torch.zeros(2, dtype=torch.long), PureDecode())
    attend(None, kv_scale=None)
    attend(None, kv_scale=torch.ones(2))
    backend.attend(None, None, None, None, 1.0, kv_scale=None)
    backend.attend(None, None, None, None, 1.0, kv_scale=torch.ones(2))
    assert seen == [kernels.decode_attention, kernels.fp8_decode_attention] * 2


def test_the_backend_hands_each_kernel_the_layers_window(monkeypatch):
    """The Triton backend passes the layer's sliding window and soft cap (None: none) to the one-kernel decode and
    to the prefill and decode-rows kernels, which take them as constexprs (0: none)."""
    from tokenmill.layers.backend import TritonBackend
    from tokenmill.layers.kernels import paged_attention
    seen = []
    monkeypatch.setattr(da, "fused_decode_attention", lambda *a, window=None, softcap=None, **k: seen.append(
        (window, softcap)))
    monkeypatch.setattr(paged_attention, "paged_attention", lambda *a, window=None, softcap=None, **k: seen.append(
        (window, softcap)))
    backend = TritonBackend()

    class PureDecode:
        def is_pure_decode(self, num_tokens):
            return True
    attend = backend.decode_attention(torch.zeros(2, dtype=torch.long), PureDecode())
    attend(None, window=None)
    attend(None, window=6, softcap=50.0)
    backend.attend(None, None, None, None, 1.0)
    backend.attend(None, None, None, None, 1.0, window=6, softcap=50.0)
    assert seen == [(None, None), (6, 50.0)] * 2
