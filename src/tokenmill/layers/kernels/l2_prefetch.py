"""Asking L2 for weights that a later kernel of the step will read, from programs that run while HBM
would otherwise idle. One place does it: the splits of decode attention that hold no positions, once
the qkv product is done, ask for the start of o_proj's weights (`decode_attention.CONFIG["l2_prefetch"]`).

A batch-1 decode step reads about 8 GB of weights in 2.5 ms, so HBM bounds it; between the products there
are stretches where little streams, and what L2 holds when the next product starts is read at L2's speed.
But asking for too much delays the reads the step waits on: three eighths of o_proj or more was slower.
Programs added to the final norm to ask for the head's first 8 MB made the step slower, and programs added
to the staging kernel for layer 0's qkv gained nothing (docs/BENCHMARKS.md), so neither is done.

`prefetch_lines` and `prefetch_line` are the device part; `share` cuts a range into programs' shares. Nothing waits for a
prefetch, and results never depend on one. The interpreter has no inline assembly, so callers pass
HOW 0 there (`how_on`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE_BYTES = 128


@triton.jit
def prefetch_lines(ptr, first, end, LINE: tl.constexpr, THREADS: tl.constexpr, HOW: tl.constexpr):
    # Ask L2 for 128-byte lines first .. end of ptr (LINE elements a line), a run of them per thread.
    # HOW 1: one `prefetch.global.L2` per line; 2: one `cp.async.bulk.prefetch.L2` per run.
    per = tl.cdiv(end - first, THREADS)
    lo = tl.minimum(first + tl.arange(0, THREADS) * per, end)
    hi = tl.minimum(lo + per, end)
    if HOW == 2:
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, $2, 0;\n\t"
            "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
            "=r,l,r", [ptr + lo.to(tl.int64) * LINE, ((hi - lo) * 128).to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
    elif HOW == 1:
        for i in range(0, per):  # past a thread's run it repeats its last line (or the range's first)
            prefetch_line(ptr + tl.maximum(tl.minimum(lo + i, hi - 1), first).to(tl.int64) * LINE)


@triton.jit
def prefetch_line(ptrs):
    # ask L2 for the 128-byte line of each pointer
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def share(first, end, part, parts):
    # part `part` of `parts` equal shares of first .. end: (its first, its end)
    per = tl.cdiv(tl.maximum(end - first, 0), parts)
    lo = tl.minimum(first + part * per, end)
    return lo, tl.minimum(lo + per, end)


def how_on(t: torch.Tensor, how: int) -> int:
    """`how` where the kernels run on a GPU, else 0 (the interpreter has no inline assembly)."""
    return how if t.is_cuda else 0


def lines(t: torch.Tensor, lo: float, hi: float) -> tuple[int, int]:
    """128-byte lines lo .. hi (fractions of the whole) of the contiguous tensor `t`."""
    if not t.is_contiguous():
        raise ValueError(f"l2 prefetch: the tensor must be contiguous, got strides {tuple(t.stride())}")
    n = t.numel() * t.element_size() // LINE_BYTES
    return int(n * lo), int(n * hi)


def line_elems(t: torch.Tensor) -> int:
    return LINE_BYTES // t.element_size()
