"""A step's inputs into the CUDA graphs' static buffers, and its sampled tokens back to the host, as
kernels that read and write pinned host memory directly.

Between two batch-1 decode graphs the stream would otherwise run the sampler's argmax, a copy of the
tokens to the host, a copy of the next step's inputs to the device and a device copy of the tokens into
the placeholders of those inputs. Copies run on the copy engines, and each hand-over between a copy
engine and the compute engine costs several microseconds, about 40 us a step in all on an H200
(docs/BENCHMARKS.md). Here the compute engine does both ends itself: `stage` copies the packed inputs
from pinned host memory (which the GPU addresses directly, unified virtual addressing) and fills each
placeholder token from the previous step's sampled tokens on the device; `publish` writes the sampled
tokens into pinned host memory. `mapped_host_ok` checks once per device that the GPU can do so;
where it cannot, the runner keeps the copies.

Placeholders: an input id below zero, -(row + 1), stands for the token sampled in row `row` of the
step before (`prev`); where the inputs go over by copy, `fill_placeholders` resolves them on the
device afterwards. References: `stage_torch`, `publish` on the CPU (tests/test_kernels.py).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

BLOCK = 1024


# sizes vary by step: one compiled variant for all of them
@triton.jit(do_not_specialize=["word_start", "word_end", "n_ids"])
def _stage_kernel(src_words, dst_words, word_start, word_end, src_ids, dst_ids, n_ids, prev_ptr,
                  HAS_PREV: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    w = word_start + pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_words + w, tl.load(src_words + w, mask=w < word_end), mask=w < word_end)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(src_ids + i, mask=i < n_ids, other=0)
    if HAS_PREV:
        held = ids < 0
        ids = tl.where(held, tl.load(prev_ptr + (-ids - 1), mask=held & (i < n_ids), other=0), ids)
    tl.store(dst_ids + i, ids, mask=i < n_ids)


@triton.jit(do_not_specialize=["n"])
def _publish_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n), mask=i < n)


def _check(dst: torch.Tensor, src: torch.Tensor, nbytes: int, ids_bytes: int, n_ids: int) -> None:
    if dst.dtype != torch.uint8 or src.dtype != torch.uint8 or min(dst.numel(), src.numel()) < nbytes:
        raise ValueError(f"stage: dst and src must be uint8 buffers of at least {nbytes} bytes, got "
                         f"{dst.dtype} {dst.numel()} and {src.dtype} {src.numel()}")
    if nbytes % 4 or ids_bytes % 8 or n_ids * 8 > ids_bytes or ids_bytes > nbytes:
        raise ValueError(f"stage: {nbytes} bytes with {n_ids} ids in the first {ids_bytes} must be whole "
                         f"int32 words with the int64 ids inside")


def stage(dst: torch.Tensor, src: torch.Tensor, nbytes: int, ids_bytes: int, n_ids: int,
          prev: torch.Tensor | None) -> None:
    """Copies bytes [ids_bytes, nbytes) of the packed host buffer `src` to `dst`, and its first `n_ids`
    int64 input ids with each placeholder replaced by its token from `prev` (int64 on the device)."""
    _check(dst, src, nbytes, ids_bytes, n_ids)
    words = (nbytes - ids_bytes) // 4
    grid = (max(triton.cdiv(words, BLOCK), triton.cdiv(n_ids, BLOCK), 1),)
    _stage_kernel[grid](src.view(torch.int32), dst.view(torch.int32), ids_bytes // 4, nbytes // 4,
                        src.view(torch.int64), dst.view(torch.int64), n_ids,
                        prev if prev is not None else dst.view(torch.int64), HAS_PREV=prev is not None,
                        BLOCK=BLOCK, num_warps=4)


def _resolved(ids: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    return torch.where(ids < 0, prev[(-ids - 1).clamp(min=0)], ids)


def stage_torch(dst: torch.Tensor, src: torch.Tensor, nbytes: int, ids_bytes: int, n_ids: int,
                prev: torch.Tensor | None) -> None:
    """Reference for `stage` (any devices)."""
    _check(dst, src, nbytes, ids_bytes, n_ids)
    dst[ids_bytes:nbytes].copy_(src[ids_bytes:nbytes].to(dst.device))
    ids = src[:n_ids * 8].view(torch.int64).to(dst.device)
    dst[:n_ids * 8].view(torch.int64).copy_(ids if prev is None else _resolved(ids, prev))


def fill_placeholders(ids: torch.Tensor, prev: torch.Tensor) -> None:
    """Replaces each placeholder in the int64 input ids `ids` (already on the device) by its token from
    `prev`, in place: `stage`'s fill alone (one kernel on CUDA), where the inputs went over by copy."""
    if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous() or prev.device != ids.device:
        raise ValueError(f"fill_placeholders: ids must be contiguous int64 [n] on prev's device, got "
                         f"{ids.dtype} {tuple(ids.shape)} on {ids.device} (prev on {prev.device})")
    n = ids.numel()
    if not ids.is_cuda:
        ids.copy_(_resolved(ids, prev))
    elif n:
        _stage_kernel[(triton.cdiv(n, BLOCK),)](ids.view(torch.int32), ids.view(torch.int32), 0, 0, ids, ids,
                                               n, prev, HAS_PREV=True, BLOCK=BLOCK, num_warps=4)


def publish(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copies int64 `src` (device) into `dst` (pinned host memory) with a kernel."""
    if src.dtype != dst.dtype or src.numel() > dst.numel() or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"publish: {src.dtype} {tuple(src.shape)} into {dst.dtype} {tuple(dst.shape)}")
    n = src.numel()
    _publish_kernel[(max(triton.cdiv(n, BLOCK), 1),)](src, dst, n, BLOCK=BLOCK, num_warps=4)


@lru_cache(maxsize=None)
def mapped_host_ok(device_index: int) -> bool:
    """Whether kernels on this GPU read and write pinned host memory through its own pointer: a staged
    copy (with and without placeholders) and a published copy are tried once, and checked. This also
    compiles the kernels before any step needs them."""
    device = torch.device("cuda", device_index)
    try:
        with torch.cuda.device(device):
            src = torch.arange(64, dtype=torch.int64).pin_memory()
            src[3] = -2
            dst = torch.zeros(512, dtype=torch.uint8, device=device)
            prev = torch.tensor([7, 8], dtype=torch.int64, device=device)
            stage(dst, src.view(torch.uint8), 512, 256, 32, None)
            plain = dst.clone()
            stage(dst, src.view(torch.uint8), 512, 256, 32, prev)
            back = torch.zeros(64, dtype=torch.int64).pin_memory()
            publish(dst.view(torch.int64), back)
            torch.cuda.synchronize(device)
        expect = torch.arange(64, dtype=torch.int64)
        expect[3] = 8
        return bool(torch.equal(back, expect)) and int(plain.view(torch.int64)[3]) == -2
    except Exception:      # noqa: BLE001 - any failure means the copies stay on the copy engines
        return False
