"""Paged attention: K/V live in a block-structured cache and are reached through block tables.

Cache layout, per layer: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim];
token slot `s` is block `s // block_size`, offset `s % block_size`. A slot of -1 is padding and is
never written.

`AttentionMetadata` describes one flattened batch of T new tokens from B sequences: sequence b owns
queries `query_start_loc[b]:query_start_loc[b+1]` and, after this step's K/V are written, has
`context_lens[b]` tokens in the cache; its i-th new query sits at position
`context_lens[b] - q_len_b + i` and attends causally to every cached position up to its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenmill.layers.kernel_config import PrefillAttentionConfig

# query rows per program of the GPU prefill kernel; `prefill_tiles` cuts sequences into such tiles
PREFILL_BLOCK_M = PrefillAttentionConfig.block_m


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64
    query_start_loc: torch.Tensor   # [B + 1] int32
    context_lens: torch.Tensor      # [B] int32
    block_tables: torch.Tensor      # [B, max_blocks_per_seq] int32
    max_query_len: int
    max_context_len: int
    prefill_tiles: torch.Tensor | None = None   # [2, n] int32 from `prefill_tiles`, or None

    def is_pure_decode(self, num_tokens: int) -> bool:
        """One new token for each sequence and no padding tokens: the steps the decode kernels take."""
        return self.max_query_len == 1 and num_tokens == self.block_tables.shape[0]


def prefill_tiles(query_lens: np.ndarray, num_tiles: int | None = None,
                  block_m: int = PREFILL_BLOCK_M) -> np.ndarray:
    """The (sequence, query-block) pairs of a batch, one column per tile of `block_m` query rows,
    padded to `num_tiles` columns (default: none) with a block index too large to hold queries. A
    batch of T tokens in B sequences needs at most T // block_m + B tiles."""
    per_seq = -(-np.asarray(query_lens, dtype=np.int64) // block_m)
    total = int(per_seq.sum())
    num_tiles = total if num_tiles is None else num_tiles
    if total > num_tiles:
        raise ValueError(f"{total} query tiles do not fit in {num_tiles}")
    tiles = np.empty((2, num_tiles), dtype=np.int32)
    tiles[0, :total] = np.repeat(np.arange(len(per_seq)), per_seq)
    tiles[1, :total] = np.arange(total) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    tiles[0, total:] = 0
    tiles[1, total:] = np.iinfo(np.int32).max // (2 * block_m)
    return tiles


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference for every attention kernel. q: [T, Hq, D] -> [T, Hq, D], softmax in float32."""
    out = torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
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
    kernel already stored them). The runner binds the layer's `k_cache` / `v_cache` once the cache is
    allocated; `prefill_config` is the CUDA kernel's (`LlamaForCausalLM.use_kernels`)."""

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
                                     meta.context_lens, meta.query_start_loc, self.scale)
