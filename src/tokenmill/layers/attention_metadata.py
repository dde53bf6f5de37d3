"""What attention needs to know about one step's batch, shared by the model, the runner and the kernels.

`AttentionMetadata` describes one flattened batch of T new tokens from B sequences: sequence b owns
queries `query_start_loc[b]:query_start_loc[b+1]` and, after this step's K/V are written, has
`seq_lens[b]` tokens in the cache; its i-th new query sits at position `seq_lens[b] - q_len_b + i` and
attends causally to every cached position up to its own. Slots (`slot_mapping`) and block tables follow
the cache layout of `attention.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.layers.kernel_config import PrefillAttentionConfig

# query rows per program of the GPU prefill kernel; `prefill_tiles` cuts sequences into such tiles
PREFILL_BLOCK_M = PrefillAttentionConfig.block_m


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64
    query_start_loc: torch.Tensor   # [B + 1] int32
    seq_lens: torch.Tensor      # [B] int32
    block_tables: torch.Tensor      # [B, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    prefill_tiles: torch.Tensor | None = None   # [2, n] int32 from `prefill_tiles`, or None

    def is_pure_decode(self, num_tokens: int) -> bool:
        """One new token for each sequence and no padding tokens: the steps the decode kernels take."""
        return self.max_query_len == 1 and num_tokens == self.block_tables.shape[0]


def prefill_tiles(query_lens: np.ndarray, num_tiles: int | None = None,
                  block_m: int = PREFILL_BLOCK_M) -> np.ndarray:
    """The (sequence, query-block) pairs of a batch's prefill chunks, one column per tile of `block_m`
    query rows, padded to `num_tiles` columns (default: none) with a block index too large to hold
    queries. A sequence of one query (a decode row) has no tile: the prefill kernel leaves it to the
    decode-rows kernel. A batch of T tokens in B sequences needs at most T // block_m + B tiles."""
    lens = np.asarray(query_lens, dtype=np.int64)
    per_seq = np.where(lens > 1, -(-lens // block_m), 0)
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
