"""Split-K for products of few input rows (`fp8_gemm.fp8_rows`): SPLIT programs share a row block's K
steps, so that a product of few row blocks still fills the SMs.

Deterministic: each split writes its partial sums to a scratch, and the row block's last split to arrive
adds them in split order (the same sums whichever arrives last) and finishes the rows. Its arrival counter
returns to zero for the next launch, so the counters need no clearing between launches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, blocks: int) -> torch.Tensor:
    """One arrival counter per row block, zero between launches; the products of a step run one after
    another on one stream, so they share one buffer."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < blocks:
        _COUNTERS[device] = have = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
    return have


@triton.jit
def k_range(K, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """[k_begin, k_end) of this program's split (program_id(1)), in whole BLOCK_K steps."""
    split_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT)
    k_begin = tl.program_id(1) * split_steps * BLOCK_K
    return k_begin, tl.minimum(k_begin + split_steps * BLOCK_K, K)


@triton.jit
def gather(acc, out_mask, part_ptr, count_ptr, rows, m, N, WIDTH, SPLIT: tl.constexpr):
    """The tile's whole sums [BLOCK_N, BLOCK_M] (weight rows `rows`, input rows `m`) and the mask of the
    outputs this program stores: `out_mask` in the last split to arrive, nothing in the others.
    `part_ptr`: float32 [SPLIT, N, WIDTH], WIDTH covering every input row of the launch; one arrival
    counter per tile (program_id(0))."""
    if SPLIT > 1:
        pid = tl.program_id(0)
        tile = rows.to(tl.int64)[:, None] * WIDTH + m[None, :]
        tl.store(part_ptr + tl.program_id(1) * N * WIDTH + tile, acc, mask=out_mask)
        tl.debug_barrier()
        last = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel") == SPLIT - 1
        out_mask &= last
        acc = tl.zeros(acc.shape, tl.float32)
        for i in range(SPLIT):
            acc += tl.load(part_ptr + i * N * WIDTH + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + pid, 0, mask=last)
    return acc, out_mask


def scratch(device: torch.device, split: int, n: int, width: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(part, counters) for a launch of `split` splits over `blocks` tiles of an n-row product whose input
    rows fit in `width` (with one split, placeholders the kernel does not read)."""
    if split == 1:
        part = torch.empty(1, dtype=torch.float32, device=device)
        return part, part
    return torch.empty((split, n, width), dtype=torch.float32, device=device), counters(device, blocks)
