"""Paged attention: K/V live in a block-structured cache and are reached through block tables.

Cache layout, per layer: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim];
token slot `s` is block `s // block_size`, offset `s % block_size`. A slot of -1 is padding and is
never written. A batch reaches the cache through `AttentionMetadata` (attention_metadata.py); the
model's backend (backend.py) runs these references or the kernels.
"""
from __future__ import annotations

import torch
from torch import nn


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference for every attention kernel. q: [T, Hq, D] -> [T, Hq, D], softmax in float32.

    Sequences with one query token (decodes) are attended together, padded to the longest context;
    a sequence with several (a prefill chunk) is attended on its own, so no step holds scores larger
    than one chunk's [Hq, q_len, context]."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    if decodes:
        rows = torch.tensor([starts[b] for b in decodes], device=q.device)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, block_tables[decodes], seq_lens[decodes],
                                      max(lens[b] for b in decodes), scale)
    for b, ctx in enumerate(lens):
        qs, qe = starts[b], starts[b + 1]
        if qe - qs > 1:
            out[qs:qe] = _prefill_attention(q[qs:qe], k_cache, v_cache, block_tables[b], ctx, scale)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """[..., length, Hkv, D] in float32: the first `length` slots of the blocks listed in `blocks`."""
    return cache[blocks.long()].flatten(-4, -3)[..., :length, :, :].float()


def _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_len: int, scale: float):
    """q [B, Hq, D], one query per sequence at its last position; contexts padded to `max_len`."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    blocks = block_tables[:, : (max_len + block_size - 1) // block_size]
    k = _gather(k_cache, blocks, max_len)                           # [B, L, Hkv, D]
    v = _gather(v_cache, blocks, max_len)
    qg = q.float().unflatten(1, (num_kv_heads, -1))                 # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    pad = torch.arange(max_len, device=q.device)[None, :] >= seq_lens[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)      # a padded slot (seq_len 0) attends to nothing: zeros
    return torch.einsum("bhgl,blhd->bhgd", probs, v).flatten(1, 2).to(q.dtype)


def _prefill_attention(q, k_cache, v_cache, block_table, ctx: int, scale: float):
    """q [Lq, Hq, D], the last Lq positions of a context of `ctx`, causal."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    k = _gather(k_cache, block_table[: (ctx + block_size - 1) // block_size], ctx)   # [ctx, Hkv, D]
    v = _gather(v_cache, block_table[: (ctx + block_size - 1) // block_size], ctx)
    qg = q.float().unflatten(1, (num_kv_heads, -1))                 # [Lq, Hkv, G, D]
    scores = torch.einsum("qhgd,khd->hgqk", qg, k) * scale
    q_pos = torch.arange(ctx - q.shape[0], ctx, device=q.device)
    scores.masked_fill_(torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hgqk,khd->qhgd", scores.softmax(-1), v).flatten(1, 2).to(q.dtype)


class PagedAttention(nn.Module):
    """One layer's view of the paged KV cache and its softmax scale; the model's backend stores this
    step's K/V into it and attends over it. `k_cache` / `v_cache` are bound by
    `LlamaForCausalLM.bind_kv_cache` once the runner has allocated the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_cache = self.v_cache = torch.empty(0)
