"""FP8 activations for the W8A8 products (`fp8_gemm`, `fp8_block_gemm`): each input row quantized with its
absmax / 448 (`quantize_rows`; per row, or per block of columns as block-scaled checkpoints' dynamic scheme
has it), or taken as its producer quantized it (`Fp8Rows`), and the weights the kernels take.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.quant.fp8 import FP8, FP8_MAX, Fp8Rows


def quantized_rows(x: torch.Tensor | Fp8Rows, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows in FP8 with their scales, `group` columns a scale: quantized here, or as their producer
    quantized them."""
    if isinstance(x, Fp8Rows):
        if x.group != group:
            raise ValueError(f"input rows quantized {x.group} columns a scale; this product takes {group}")
        return x.q, x.scale
    return quantize_rows(x, group)


def check_weight(kernel: str, k: int, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    """What the W8A8 kernels take: an FP8 weight [N, k] with unit column stride and float32 scales, one per
    block."""
    n = weight.shape[0]
    if weight.dtype != FP8 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"{kernel} needs an FP8 weight [N, {k}] with unit column stride; got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (-(-n // block[0]), -(-k // block[1])):
        raise ValueError(f"{kernel}: scale {scale.dtype} {tuple(scale.shape)} does not fit weight "
                         f"{tuple(weight.shape)} with block {block}")


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, x_stride, q_stride, s_stride, GROUP: tl.constexpr,
                          FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (row, g): columns g * GROUP ... of the row, quantized with their absmax / FP8_MAX
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    c = tl.arange(0, BLOCK_K)
    cols = g * GROUP + c
    mask = (c < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * s_stride + g, scale)


def quantize_rows_torch(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `quantize_rows`."""
    M, K = x.shape
    group = group or K
    groups = -(-K // group)
    padded = F.pad(x.float(), (0, groups * group - K)).view(M, groups, group)
    scale = padded.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    q = (padded / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(M, -1)[:, :K]
    return q.to(FP8), scale


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 activations: x [M, K] -> (FP8 [M, K], float32 scale [M, ceil(K / group)]), each group of
    `group` columns (default: the whole row, one scale per token) scaled by its absmax / 448, so x ~= q *
    its group's scale."""
    M, K = x.shape
    if x.stride(1) != 1:
        raise ValueError("quantize_rows needs unit column strides")
    group = group or K
    groups = triton.cdiv(K, group)
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    scale = torch.empty(M, groups, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(group)
    _quantize_rows_kernel[(M, groups)](x, q, scale, K, x.stride(0), q.stride(0), scale.stride(0), GROUP=group,
                                       FP8_MAX=FP8_MAX, BLOCK_K=block, num_warps=8 if block > 4096 else 4)
    return q, scale
