"""Products with FP8 weights (`layers/fp8_linear.Fp8Linear`): `fp8_linear` picks one path per batch shape.

A step of one token does not come here: its layers run the single-token products of `gemv.py`, which
read the FP8 weights with their scales and fold the norms and SiLU-and-mul in, as for 16-bit weights.

- Per-channel scales: W8A8 on the FP8 tensor cores, `torch._scaled_mm` with the weight's per-channel
  scales and dynamic per-token activation scales (`quantize_rows`: each row's absmax / 448), from one row
  on. At 2-8 rows it took 0.4-0.9x the time of the weight-only GEMV below on an H200 (qwen3-4b shapes,
  docs/BENCHMARKS.md), whose widening of each FP8 weight in registers costs more instructions than the
  bytes it saves; above, the products are bound by compute, which FP8 doubles.
- Block scales, up to `FEW_ROWS` input rows (small-batch decode): `_fp8_gemv_kernel`, weight-only
  (W8A16): the weights widened in registers, each times its block's scale, the activations as they are.
  More rows: the layer is dequantized to the activation dtype and multiplied there (the rowwise
  `_scaled_mm` cannot apply a scale that changes along K).

`fp8_linear_torch` (dequantize, then `F.linear`) is the reference the kernels are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.quant.fp8 import FP8, FP8_MAX, dequantize

FEW_ROWS = 8


@dataclass(frozen=True)
class Fp8GemvTile:
    """A program holds block_m (input rows, padded to a power of two) x block_n weight rows x block_k
    columns of products in registers and walks K in block_k steps."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def gemv_tile(rows: int) -> Fp8GemvTile:
    block_m = triton.next_power_of_2(rows)
    # small row blocks, so that even a 2560-row product spreads over several programs per SM; 2048-4096
    # products per program step, summed per element (16-32 float32 accumulators per thread of 4 warps)
    return Fp8GemvTile(block_m=block_m, block_n=max(1, 4 // block_m), block_k=512, num_warps=4)


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: x @ (weight * block scale)^T (+ bias), the weight dequantized in float32, then cast to x's
    dtype."""
    return F.linear(x, dequantize(weight, scale, block).to(x.dtype), bias)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, x_stride, w_stride, s_stride, out_stride,
                     SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program p: output columns p * BLOCK_N ... of every input row (M <= BLOCK_M)
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)
    m_ok, n_ok = m < M, n < N
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_stride
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride
    # products summed per element over K, reduced across the threads once at the end (a reduction per
    # chunk would cost a shuffle and shared-memory round per BLOCK_K columns)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + c < K
        x = tl.load(x_rows + k0 + c[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_rows + k0 + c[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        # each weight times its block's scale (a few distinct values per tile, cached)
        w *= tl.load(s_ptr + (n // SCALE_BN)[:, None] * s_stride + ((k0 + c) // SCALE_BK)[None, :],
                     mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc3 += x[:, None, :] * w[None, :, :]
    acc = tl.sum(acc3, 2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m.to(tl.int64)[:, None] * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= FEW_ROWS, K] @ (weight [N, K] FP8 * block scale)^T (+ bias), W8A16, in x's dtype; for block
    scales only (per-channel weights take W8A8 at any row count)."""
    M, K = x.shape
    N = weight.shape[0]
    if M > FEW_ROWS:
        raise ValueError(f"fp8_gemv takes at most {FEW_ROWS} rows, got {M}")
    if weight.dtype != FP8 or weight.shape[1] != K or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"fp8_gemv needs an FP8 weight [N, {K}] and x with unit column strides; got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if block == (1, K):
        raise ValueError("fp8_gemv is for block scales; per-channel FP8 weights take the W8A8 product")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (-(-N // block[0]), -(-K // block[1])):
        raise ValueError(f"fp8_gemv: scale {scale.dtype} {tuple(scale.shape)} does not fit weight "
                         f"{tuple(weight.shape)} with block {block}")
    tile = gemv_tile(M)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, tile.block_n),)
    _fp8_gemv_kernel[grid](x, weight, scale, bias if bias is not None else out, out, M, N, K, x.stride(0),
                           weight.stride(0), scale.stride(0), out.stride(0), SCALE_BN=block[0], SCALE_BK=block[1],
                           HAS_BIAS=bias is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                           BLOCK_K=tile.block_k, num_warps=tile.num_warps)
    return out


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, x_stride, q_stride, FP8_MAX: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * x_stride + c, mask=c < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * q_stride + c, q.to(q_ptr.dtype.element_ty), mask=c < K)
    tl.store(s_ptr + row, scale)


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `quantize_rows`."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8: x [M, K] -> (FP8 [M, K], float32 scale [M, 1]), scale = the row's absmax /
    448, so x ~= q * scale."""
    M, K = x.shape
    if x.stride(1) != 1:
        raise ValueError("quantize_rows needs unit column strides")
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                BLOCK_K=triton.next_power_of_2(K), num_warps=8 if K > 4096 else 4)
    return q, scale


def scaled_mm_fits(weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """`torch._scaled_mm` with rowwise scales: per-channel scales and both dims multiples of 16."""
    n, k = weight.shape
    return block[1] == k and block[0] == 1 and n % 16 == 0 and k % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ W^T (+ bias) on CUDA, by the path of the module docstring."""
    if scaled_mm_fits(weight, block):
        xq, x_scale = quantize_rows(x)
        # the bias is added apart: not every _scaled_mm kernel takes one with rowwise scales
        out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
        return out if bias is None else out.add_(bias)
    if x.shape[0] <= FEW_ROWS:
        return fp8_gemv(x, weight, scale, block, bias)
    return fp8_linear_torch(x, weight, scale, block, bias)
