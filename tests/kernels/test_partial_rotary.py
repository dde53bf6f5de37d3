"""Partial rotary (Phi-4-mini: 96 of 128 dims of a head, transformers' rotate_half over those alone) through
each RoPE path, which rotate the whole head with the table: a table whose columns past the rotated frequencies
are the identity, over q and k whose rows are in `rotary_order`, gives transformers' rotation of the checkpoint's
q and k in that order, its LongRoPE attention factor on the rotated dims alone. So Phi-3's partial rotary needs
no kernel of its own."""
from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from kernel_testing import DEVICE, HALF, _gen, _paged_cache, _randn, _tol
from tokenmill.layers.attention import paged_attention_torch
from tokenmill.layers.backend import TorchBackend
from tokenmill.layers.kernel_config import DecodeAttentionConfig
from tokenmill.layers.kernels import attention_prologue as ops, decode_attention as da
from tokenmill.layers.rotary import RotaryEmbedding, rotary_order

HEADS, KV_HEADS, HEAD_DIM, ROTARY = 4, 2, 16, 12
CONTEXT, ORIGINAL = 256, 64
SHORT, LONG = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], [2.0, 3.0, 4.5, 6.0, 8.0, 9.5]
ORDER = rotary_order(HEAD_DIM, ROTARY)


def _transformers_rope():
    """transformers' Phi3 RoPE with LongRoPE over 12 of 16 dims (its long factors past 64 positions), and ours
    for a served context of 256: the same frequencies and attention factor sqrt(1 + ln 4 / ln 64)."""
    cfg = Phi3Config(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                     max_position_embeddings=CONTEXT, original_max_position_embeddings=ORIGINAL,
                     partial_rotary_factor=ROTARY / HEAD_DIM, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                     rope_parameters={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                      "rope_theta": 1e4})
    scaling = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": CONTEXT / ORIGINAL,
               "original_max_position_embeddings": ORIGINAL}
    ours = RotaryEmbedding(HEAD_DIM, CONTEXT, 1e4, scaling, rotary_dim=ROTARY)
    return Phi3RotaryEmbedding(cfg), ours.cos_sin.to(DEVICE)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.reshape(-1, heads, HEAD_DIM)


def _rotated_by_transformers(qkv: torch.Tensor, positions: torch.Tensor):
    """q and k [T, heads, D] as transformers rotates them, the checkpoint's order."""
    rope, _ = _transformers_rope()
    q, k, _ = qkv.float().cpu().split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    # one forward pass over positions past 64 (the long factors): transformers' batch [1, T]
    cos, sin = rope(q, positions.cpu()[None])
    q, k = apply_rotary_pos_emb(_heads(q, HEADS).transpose(0, 1)[None], _heads(k, KV_HEADS).transpose(0, 1)[None],
                                cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


def _in_rotary_order(qkv: torch.Tensor) -> torch.Tensor:
    """qkv with q's and k's rows of each head in `rotary_order`, as the loader puts the projections' rows."""
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    return torch.cat((_heads(q, HEADS)[..., ORDER].flatten(1), _heads(k, KV_HEADS)[..., ORDER].flatten(1), v), -1)


def test_rotary_order_pairs_the_rotated_halves_and_passes_the_rest():
    # pairs (0, 6) .. (5, 11) at (p, p + 8); dims 12 .. 15 at the identity columns 6, 7, 14, 15
    assert ORDER.tolist() == [0, 1, 2, 3, 4, 5, 12, 13, 6, 7, 8, 9, 10, 11, 14, 15]
    assert torch.equal(rotary_order(HEAD_DIM, HEAD_DIM), torch.arange(HEAD_DIM))
    _, table = _transformers_rope()
    assert torch.equal(table[:, 6:8].cpu(), torch.ones(CONTEXT, 2)) and not table[:, 14:].any()


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_prologue_paths_rotate_as_transformers(dtype):
    """The torch reference and the Triton prologue return q and store k as transformers rotates the
    checkpoint's q and k, in `rotary_order`, at positions past the original context (v as in qkv)."""
    gen = _gen(7)
    _, table = _transformers_rope()
    qkv = _randn(6, (HEADS + 2 * KV_HEADS) * HEAD_DIM, gen=gen)
    positions = torch.tensor([0, 1, 63, 64, 200, 255], device=DEVICE)
    slots = torch.tensor([5, 0, 3, 1, 7, 2], device=DEVICE)
    want_q, want_k = _rotated_by_transformers(qkv, positions)
    ours = _in_rotary_order(qkv).to(dtype)
    for prologue in (TorchBackend().qk_norm_rope_store, ops.qk_norm_rope_store):
        k_cache, v_cache = (torch.zeros(2, 4, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE) for _ in range(2))
        q = prologue(ours, positions, table, None, None, 0.0, k_cache, v_cache, slots, HEADS, KV_HEADS, HEAD_DIM)
        torch.testing.assert_close(q.float().cpu(), want_q[..., ORDER], rtol=_tol(dtype), atol=_tol(dtype))
        k = k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].float().cpu()
        torch.testing.assert_close(k, want_k[..., ORDER], rtol=_tol(dtype), atol=_tol(dtype))
        assert torch.equal(v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].cpu(),
                           _heads(ours[:, (HEADS + KV_HEADS) * HEAD_DIM:], KV_HEADS).cpu())


def test_one_kernel_decode_attends_over_transformers_rotation():
    """The decode kernel rotates the new q and k as transformers does (in `rotary_order`) and attends as the
    reference attention does over them, at positions past the original context."""
    gen = _gen(9)
    _, table = _transformers_rope()
    seq_lens = [70, 1, 150, 256]
    k_cache, v_cache, blocks = _paged_cache(seq_lens, 4, KV_HEADS, HEAD_DIM, torch.float32, gen)
    ctx = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    positions = (ctx - 1).long()
    slots = blocks.long().gather(1, (positions // 4)[:, None])[:, 0] * 4 + positions % 4
    qkv = _randn(len(seq_lens), (HEADS + 2 * KV_HEADS) * HEAD_DIM, gen=gen)
    want_q, want_k = _rotated_by_transformers(qkv, positions)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_k.view(-1, KV_HEADS, HEAD_DIM)[slots] = want_k[..., ORDER].to(DEVICE)
    ref_v.view(-1, KV_HEADS, HEAD_DIM)[slots] = _heads(qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:], KV_HEADS)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_torch(want_q[..., ORDER].to(DEVICE), ref_k, ref_v, blocks, ctx, qsl, HEAD_DIM ** -0.5)
    out = da.fused_decode_attention(_in_rotary_order(qkv), positions, table, None, None, 0.0, k_cache, v_cache,
                                    slots, blocks, ctx, HEAD_DIM ** -0.5, HEADS, KV_HEADS, HEAD_DIM, num_splits=3,
                                    config=DecodeAttentionConfig(16, min_split_len=16))
    torch.testing.assert_close(k_cache, ref_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
