"""A NoPE layer's identity table (`NoRotaryEmbedding`: cos 1, sin 0) through each RoPE path: the torch
reference, the prologue kernel (q/k RoPE + cache store) and the one-kernel decode attention leave q and k
exactly as the projection gave them, at any position, so SmolLM3's NoPE layers need no kernel of their own."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import DEVICE, HALF, _gen, _paged_cache, _randn, _tol
from tokenmill.layers.attention import paged_attention_torch
from tokenmill.layers.backend import TorchBackend
from tokenmill.layers.kernel_config import DecodeAttentionConfig
from tokenmill.layers.kernels import attention_prologue as ops, decode_attention as da
from tokenmill.layers.rotary import NoRotaryEmbedding

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _split(qkv):
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    return (q.reshape(-1, HEADS, HEAD_DIM), k.reshape(-1, KV_HEADS, HEAD_DIM), v.reshape(-1, KV_HEADS, HEAD_DIM))


def test_the_identity_table_is_cos_one_sin_zero_at_every_position():
    table = NoRotaryEmbedding(HEAD_DIM, 300).cos_sin
    assert table.dtype == torch.float32 and table.shape == (300, HEAD_DIM)
    assert torch.equal(table[:, :HEAD_DIM // 2], torch.ones(300, HEAD_DIM // 2))
    assert torch.equal(table[:, HEAD_DIM // 2:], torch.zeros(300, HEAD_DIM // 2))


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_prologue_paths_leave_q_and_k_unchanged(dtype):
    """The torch reference and the Triton prologue return q and store k (and v) bit for bit as in qkv,
    at positions up to the table's last row; with 1e4 in some values, where a rotation would show."""
    gen = _gen(3)
    cos_sin = NoRotaryEmbedding(HEAD_DIM, 4096).cos_sin.to(DEVICE)
    qkv = _randn(6, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, gen=gen)
    qkv[1, ::7] = 1e4
    positions = torch.tensor([0, 1, 17, 1000, 4094, 4095], device=DEVICE)
    slots = torch.tensor([5, 0, 3, 1, 7, 2], device=DEVICE)
    q_in, k_in, v_in = _split(qkv)
    for prologue in (TorchBackend().qk_norm_rope_store, ops.qk_norm_rope_store):
        k_cache, v_cache = (torch.zeros(2, 4, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE) for _ in range(2))
        q = prologue(qkv, positions, cos_sin, None, None, 0.0, k_cache, v_cache, slots, HEADS, KV_HEADS, HEAD_DIM)
        assert torch.equal(q, q_in)
        assert torch.equal(k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots], k_in)
        assert torch.equal(v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots], v_in)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_one_kernel_decode_attends_with_q_and_k_unrotated(dtype):
    """The decode kernel stores each new k bit for bit as in qkv and attends as the reference attention
    does with the unrotated q, over contexts whose new tokens sit at positions 0 to 149."""
    gen = _gen(5)
    seq_lens = [1, 37, 16, 150]
    k_cache, v_cache, table = _paged_cache(seq_lens, 4, KV_HEADS, HEAD_DIM, dtype, gen)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    positions = (ctx - 1).long()
    slots = table.long().gather(1, (positions // 4)[:, None])[:, 0] * 4 + positions % 4
    qkv = _randn(len(seq_lens), (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, gen=gen)
    q_in, k_in, v_in = _split(qkv)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_k.view(-1, KV_HEADS, HEAD_DIM)[slots], ref_v.view(-1, KV_HEADS, HEAD_DIM)[slots] = k_in, v_in
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_torch(q_in, ref_k, ref_v, table, ctx, qsl, HEAD_DIM ** -0.5)
    out = da.fused_decode_attention(qkv, positions, NoRotaryEmbedding(HEAD_DIM, 256).cos_sin.to(DEVICE), None, None,
                                    0.0, k_cache, v_cache, slots, table, ctx, HEAD_DIM ** -0.5, HEADS, KV_HEADS,
                                    HEAD_DIM, num_splits=3, config=DecodeAttentionConfig(16, min_split_len=16))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype))
