"""Paged attention: K/V live in a block-structured cache and are reached through block tables.

Cache layout, per layer: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim];
token slot `s` is block `s // block_size`, offset `s % block_size`. A slot of -1 is padding and is
never written. A batch reaches the cache through `AttentionMetadata` (attention_metadata.py).
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.attention_metadata import AttentionMetadata
from tokenmill.layers.kernel_config import PrefillAttentionConfig


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference for every attention kernel. q: [T, Hq, D] -> [T, Hq, D], softmax in float32."""
    out = torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        qs, qe = starts[b], starts[b + 1]
        if qe == qs:
            continue
        blocks = block_tables[b, : (ctx + block_size - 1) // block_size].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
        qb = q[qs:qe].float()
        scores = torch.einsum("lhd,khd->hlk", qb, k) * scale
        q_pos = torch.arange(ctx - (qe - qs), ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]
        scores.masked_fill_(mask, float("-inf"))
        out[qs:qe] = torch.einsum("hlk,khd->lhd", scores.softmax(-1), v).to(q.dtype)
    return out


class PagedAttention(nn.Module):
    """Writes this step's K/V into the cache, then attends over the cache (`attend` alone when a fused
    kernel already stored them). `k_cache` / `v_cache` are bound by `LlamaForCausalLM.bind_kv_cache`
    once the runner has allocated the cache; `prefill_config` is the CUDA kernel's (`use_kernels`)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_cache = self.v_cache = torch.empty(0)
        self.prefill_config = PrefillAttentionConfig()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        """The reference path (on CUDA the prologue kernels store K/V and `attend` follows)."""
        store_kvcache_torch(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D] over the cache, which must already hold this step's K/V."""
        if q.is_cuda:
            from tokenmill.layers.kernels import paged_attention as kernels
            return kernels.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.prefill_config)
        return paged_attention_torch(q, self.k_cache, self.v_cache, meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc, self.scale)
