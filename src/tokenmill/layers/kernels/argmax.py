"""Greedy choice on the device: the argmax of every row of the logits, first of equals, as torch's.

torch's argmax over one 150k-wide row is a memset plus a two-pass reduction, about 10 us at batch 1,
which a CUDA graph cannot absorb because the sampler runs after it. This kernel is one launch that the
graphs capture after the head: each program takes the maximum of one chunk of a row and stores it with
its first index; the last program of a row to finish (a counter bumped atomically, then reset) reduces
the chunks and writes the token. NaN logits are never chosen (torch would choose the first NaN).

With `publish`, the last program also writes each token into pinned host memory (which the GPU addresses
directly), into the row of a small table that a device scalar picks: a graph that ends in this kernel
hands its tokens to the host with no kernel or copy after it (`staging.py` has the same write as a kernel
of its own, for tokens that come from elsewhere).

Reference: `logits.argmax(-1)` (tests/test_kernels.py). CUDA-graph safe: the grid and the scratch
depend on shapes only, and the counters are a persistent zeroed buffer (`counters.py`) that every launch
leaves zeroed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.kernels import pdl
from tokenmill.layers.kernels.counters import zeroed as zeroed_counters

BLOCK = 4096


@triton.jit
def _argmax_kernel(logits_ptr, stride, out_ptr, part_val_ptr, part_idx_ptr, counter_ptr, V,
                   host_ptr, turn_ptr, host_stride,
                   SPLITS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, PUBLISH: tl.constexpr,
                   PDL: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    if PUBLISH:
        turn = tl.load(turn_ptr)    # step metadata, written before the forward pass
    pdl.enter(PDL)
    offs = split * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=offs < V, other=float("-inf"))
    x = x.to(tl.float32)
    m = tl.max(x, 0)
    first = tl.min(tl.where(x == m, offs, V), 0)     # V: a chunk of NaN only
    slot = row * SPLITS + split
    tl.store(part_val_ptr + slot, m)
    tl.store(part_idx_ptr + slot, first)
    # release our chunk's result, and learn whether every other chunk of the row has released its own
    done = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
    if done == SPLITS - 1:
        s = tl.arange(0, BLOCK_S)
        vals = tl.load(part_val_ptr + row * SPLITS + s, mask=s < SPLITS, other=float("-inf"),
                       cache_modifier=".cg")
        idxs = tl.load(part_idx_ptr + row * SPLITS + s, mask=s < SPLITS, other=V, cache_modifier=".cg")
        best = tl.max(vals, 0)
        token = tl.min(tl.where(vals == best, idxs, V), 0)
        token = tl.minimum(token, V - 1).to(tl.int64)
        tl.store(out_ptr + row, token)
        if PUBLISH:
            tl.store(host_ptr + turn.to(tl.int64) * host_stride + row, token)
        tl.store(counter_ptr + row, 0)   # every chunk has counted: nothing else touches it in this launch


def check_publish(publish: tuple[torch.Tensor, torch.Tensor], rows: int) -> None:
    host, turn = publish
    if (host.dtype != torch.int64 or host.dim() != 2 or host.shape[1] < rows or host.stride(1) != 1
            or turn.dtype != torch.int32 or turn.numel() != 1):
        raise ValueError(f"greedy: publish needs an int64 [turns, >= {rows}] table with unit last stride and "
                         f"an int32 turn, got {host.dtype} {tuple(host.shape)} and {turn.dtype} "
                         f"{tuple(turn.shape)}")


def greedy(logits: torch.Tensor, out: torch.Tensor | None = None, block: int = BLOCK,
           publish: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """int64 [rows]: the first index of each row's maximum of `logits` [rows, V] (any float dtype),
    from chunks of `block` columns (a power of two). `publish` (host, turn): the tokens also go to
    row `turn` (a one-element int32 tensor on the device, read when the kernel runs) of `host`, an int64
    [turns, >= rows] table in pinned host memory."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"greedy: logits must be [rows, V] with unit last stride, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if publish is not None:
        check_publish(publish, rows)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    splits = triton.cdiv(vocab, block)
    vals = torch.empty(rows * splits, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(rows * splits, dtype=torch.int32, device=logits.device)
    counters = zeroed_counters(logits.device, rows)
    pdl_on = pdl.enabled(logits.device)
    host, turn = publish if publish is not None else (out, counters)
    _argmax_kernel[(rows, splits)](logits, logits.stride(0), out, vals, idxs, counters, vocab,
                                   host, turn, host.stride(0) if publish is not None else 0,
                                   SPLITS=splits, BLOCK=block, BLOCK_S=triton.next_power_of_2(splits),
                                   PUBLISH=publish is not None, PDL=pdl_on, num_warps=4,
                                   launch_pdl=pdl_on)
    return out
