"""Paged attention: K/V live in a block-structured cache and are reached through block tables.

Cache layout, per layer: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim];
token slot `s` is block `s // block_size`, offset `s % block_size`. A slot of -1 is padding and is
never written. A batch reaches the cache through `AttentionMetadata` (attention_metadata.py); the
model's backend (backend.py) runs these references or the kernels.

An FP8 cache (`--kv-cache-dtype fp8`) holds K / scale and V / scale in float8_e4m3fn, with `kv_scale` a
float32 tensor [2] (K's scale, V's) of the layer; every reader multiplies back. Values beyond E4M3's
range (+-448 after the division) saturate to +-448 instead of becoming NaN, which the plain cast would
give on some versions. Caches in the model dtype have no scale (None).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config_values import positive

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = float(torch.finfo(FP8_KV_DTYPE).max)      # 448


def check_kv_scale(k_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> None:
    """An FP8 cache comes with its float32 [2] scales, a cache in the model dtype without."""
    if k_cache.dtype == FP8_KV_DTYPE:
        if kv_scale is None or kv_scale.shape != (2,) or kv_scale.dtype != torch.float32:
            got = None if kv_scale is None else f"{kv_scale.dtype} {tuple(kv_scale.shape)}"
            raise ValueError(f"an {FP8_KV_DTYPE} KV cache needs kv_scale, float32 [2] (K, V), got {got}")
    elif kv_scale is not None:
        raise ValueError(f"kv_scale is for an {FP8_KV_DTYPE} cache; this cache is {k_cache.dtype}")


def quantize_kv_torch(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in E4M3, saturated at +-448 (NaN stays NaN)."""
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        kv_scale: torch.Tensor | None = None) -> None:
    check_kv_scale(k_cache, kv_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key, value = key[keep], value[keep]
    if kv_scale is not None:
        key, value = quantize_kv_torch(key, kv_scale[0]), quantize_kv_torch(value, kv_scale[1])
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, scale: float,
                          kv_scale: torch.Tensor | None = None, window: int | None = None,
                          softcap: float | None = None) -> torch.Tensor:
    """Reference for every attention kernel. q: [T, Hq, D] -> [T, Hq, D], softmax in float32; an FP8
    cache is dequantized (times `kv_scale`) to float32. Decodes and prefill chunks go through torch's
    scaled_dot_product_attention and an index_select of their blocks, the CPU path's fastest (docs:
    "CPU attention over a batch"). `window` (the layer's sliding window, `ModelConfig.window`; None:
    none): a query at position p sees the cached positions j with p - window < j <= p alone
    (transformers' sliding-window mask), and the blocks wholly below every query's window are not read.
    `softcap` (`ModelConfig.attn_logit_softcapping`; None: none): each score s = q.k x scale becomes
    softcap x tanh(s / softcap) before the softmax (Gemma 2's), written out (`_attend`).

    Sequences with one query token (decodes) are attended together, padded to the longest context (on the
    CPU in groups whose gathered K and V fit its cache, `_decode_chunks`);
    a sequence with several (a prefill chunk) is attended on its own, so no step holds scores larger
    than one chunk's [Hq, q_len, context]."""
    check_kv_scale(k_cache, kv_scale)
    check_window(window)
    check_softcap(softcap)
    scales = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    for chunk in _decode_chunks(decodes, lens, k_cache, q.device):
        rows = torch.tensor([starts[b] for b in chunk], device=q.device)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, block_tables[chunk], seq_lens[chunk],
                                      [lens[b] for b in chunk], scale, scales, window, softcap)
    for b, ctx in enumerate(lens):
        qs, qe = starts[b], starts[b + 1]
        if qe - qs > 1:
            out[qs:qe] = _prefill_attention(q[qs:qe], k_cache, v_cache, block_tables[b], ctx, scale, scales,
                                            window, softcap)
    return out


# the float32 K and V a chunk of decodes gathers on the CPU, at most (one sequence may exceed it alone)
DECODE_CHUNK_BYTES = 4 << 20


def _decode_chunks(decodes: list[int], lens: list[int], k_cache: torch.Tensor, device: torch.device) -> list[list[int]]:
    """The decodes (batch indices, contexts `lens`) in the groups `_decode_attention` takes at once. On the CPU,
    shortest context first, each group as long as its gathered K and V (padded to its longest context) fit
    DECODE_CHUNK_BYTES: a group's copies are then still in the cache when attention reads them. 16, 32 and 64
    decodes of 100-380 positions (the bundled model's heads, one thread) took 5.0x, 5.4x and 4.5x less time in
    groups of 4 MiB than as one batch (docs/BENCHMARKS.md "CPU decode attention in groups that fit the cache").
    Elsewhere one group: the batch as it is."""
    if not decodes:
        return []
    if device.type != "cpu":
        return [decodes]
    per_position = 2 * k_cache.shape[2] * k_cache.shape[3] * 4
    chunks, chunk = [], []
    for b in sorted(decodes, key=lens.__getitem__):
        if chunk and (len(chunk) + 1) * lens[b] * per_position > DECODE_CHUNK_BYTES:
            chunks.append(chunk)
            chunk = []
        chunk.append(b)
    return chunks + [chunk]


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int, scale: torch.Tensor | None) -> torch.Tensor:
    """[..., length, Hkv, D] in float32: the first `length` slots of the blocks listed in `blocks`, times
    `scale` when the cache is FP8."""
    kv = cache.index_select(0, blocks.long().flatten()).view(*blocks.shape, *cache.shape[1:])
    kv = kv.flatten(-4, -3)[..., :length, :, :].float()
    return kv if scale is None else kv * scale


def _first_block(first_position: int, block_size: int) -> int:
    """The block that holds `first_position`, the lowest position a query of the batch sees (0 without
    a window, or when it is negative)."""
    return max(first_position, 0) // block_size


def _attend(q, k, v, mask, scale: float, softcap: float | None):
    """softmax(q.k x scale, masked) v over [..., Lq, D] x [..., L, D] (mask [Lq, L] or broadcast to the scores;
    None: causal from the top left): torch's fused attention, or with a `softcap` the same written out, since it
    cannot cap the scores. Scaled, divided by the cap, tanh, times the cap, then masked: transformers' order."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, lens: list[int], scale: float, scales,
                      window: int | None, softcap: float | None):
    """q [B, Hq, D], one query per sequence at its last position, contexts `lens` (seq_lens on the host);
    the positions from the lowest window's block on are gathered, padded to the longest context."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = max(lens)
    first = 0 if window is None else _first_block(min(lens) - window, block_size)
    blocks = block_tables[:, first: (max_len + block_size - 1) // block_size]
    k = _gather(k_cache, blocks, max_len - first * block_size, scales[0])     # [B, L, Hkv, D]
    v = _gather(v_cache, blocks, max_len - first * block_size, scales[1])
    qg = q.float().unflatten(1, (num_kv_heads, -1))                 # [B, Hkv, G, D]
    pos = torch.arange(first * block_size, max_len, device=q.device)[None, :]
    keep = pos < seq_lens[:, None]
    if window is not None:
        keep &= pos >= seq_lens[:, None] - window
    out = _attend(qg, k.transpose(1, 2), v.transpose(1, 2), keep[:, None, None, :], scale, softcap)
    # a padded slot (seq_len 0) attends to nothing: its NaN row becomes zeros
    return out.nan_to_num(0.0).flatten(1, 2).to(q.dtype)


def _prefill_attention(q, k_cache, v_cache, block_table, ctx: int, scale: float, scales, window: int | None,
                       softcap: float | None):
    """q [Lq, Hq, D], the last Lq positions of a context of `ctx`, causal (and within `window`)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    lq = q.shape[0]
    first = 0 if window is None else _first_block(ctx - lq + 1 - window, block_size)
    blocks = block_table[first: (ctx + block_size - 1) // block_size]
    k = _gather(k_cache, blocks, ctx - first * block_size, scales[0])       # [L, Hkv, D]
    v = _gather(v_cache, blocks, ctx - first * block_size, scales[1])
    qg = q.float().unflatten(1, (num_kv_heads, -1)).permute(1, 2, 0, 3)     # [Hkv, G, Lq, D]
    k, v = (t.permute(1, 0, 2)[:, None].expand(-1, qg.shape[1], -1, -1) for t in (k, v))   # [Hkv, G, L, D]
    # causal from the bottom right: query i, at position ctx - Lq + i, sees the keys up to its own
    # (torch's is_causal aligns them from the top left, which is the same only without a cached prefix)
    mask = None
    if lq != ctx or window is not None:
        keys = torch.arange(first * block_size, ctx, device=q.device)[None, :]
        queries = torch.arange(ctx - lq, ctx, device=q.device)[:, None]
        mask = keys <= queries
        if window is not None:
            mask &= keys > queries - window
    out = _attend(qg, k, v, mask, scale, softcap)
    return out.permute(2, 0, 1, 3).flatten(1, 2).to(q.dtype)


def check_window(window: int | None) -> None:
    """A layer's sliding window is a positive int (positions a query sees, its own included), or None."""
    if window is not None and (type(window) is not int or window < 1):
        raise ValueError(f"window is {window!r}; it must be an integer >= 1 (the positions a query sees, its own "
                         "included), or None for none")


def check_softcap(softcap: float | None) -> None:
    """A layer's attention soft cap is a positive finite number (scores s become softcap x tanh(s / softcap)),
    or None for none."""
    if softcap is not None and not positive(softcap):
        raise ValueError(f"softcap is {softcap!r}; it must be a positive finite number (scores s become "
                         "softcap * tanh(s / softcap)), or None for none")


class PagedAttention(nn.Module):
    """One layer's view of the paged KV cache, its softmax scale, sliding window and soft cap; the model's
    backend stores this step's K/V into it and attends over it. `k_cache` / `v_cache` are bound by
    `LlamaForCausalLM.bind_kv_cache` once the runner has allocated the cache. `scale` (q.k times it before
    the softmax; `ModelConfig.attention_scale`), `window` (`ModelConfig.window`: the positions a query
    sees, its own included; None: the whole context) and `softcap` (`ModelConfig.attn_logit_softcapping`:
    the scaled scores s become softcap x tanh(s / softcap); None: none) are the ones every attention path
    reads: the reference, the Triton prefill and decode kernels. The cache keeps every position (blocks
    below the window are not freed)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int | None = None,
                 softcap: float | None = None):
        super().__init__()
        check_window(window)
        check_softcap(softcap)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.window = window
        self.softcap = softcap
        self.k_cache = self.v_cache = torch.empty(0)
        self.kv_scale: torch.Tensor | None = None     # float32 [2] (K, V) with an FP8 cache
