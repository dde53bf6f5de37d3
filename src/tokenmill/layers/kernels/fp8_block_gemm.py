"""Block-scaled W8A8 products of many rows (`fp8_gemm.fp8_linear` above `BLOCK_GEMM_ROWS` input rows):
`_fp8_block_gemm_kernel`, the input rows on the tensor cores' wide side, each K step's product scaled in
float32, since the rowwise `_scaled_mm` cannot apply a scale that changes along K.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.layers.kernels.fp8_quantize import check_weight, quantized_rows
from tokenmill.quant.fp8 import Fp8Rows


@dataclass(frozen=True)
class Fp8GemmTile:
    """`_fp8_block_gemm_kernel`: a program multiplies block_m input rows by block_n weight rows, walking K in
    block_k steps with num_stages of them in flight."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


WIDE_TILE_ROWS = 512   # products of this many input rows and more take 128 weight rows a tile where blocks allow


def gemm_tile(block: tuple[int, int], m: int = 1) -> Fp8GemmTile | None:
    """The tile of a block-scaled product of m input rows, or None where the scale blocks admit none: 64
    input rows by 128 columns and 64 weight rows below 512 input rows, 128 from there (a tile lies within
    one scale block, so that each step takes one weight scale; fewer where a block is smaller), four
    steps in flight. On an H200 (qwen3-4b's products, 128 x 128 blocks) these were the fastest of five
    tiles over a layer at 64-256 rows and 2,048-8,192, and within 1% of them at 512."""
    block_n = next((b for b in ((64, 32, 16) if m < WIDE_TILE_ROWS else (128, 64, 32, 16)) if block[0] % b == 0), None)
    block_k = next((b for b in (128, 64, 32) if block[1] % b == 0), None)
    if block_n is None or block_k is None:
        return None
    return Fp8GemmTile(64, block_n, block_k, 4, 4)


@triton.jit(do_not_specialize=["M"])
def _fp8_block_gemm_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, x_stride, xs_stride, w_stride,
                           s_stride, out_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, SCALE_BN: tl.constexpr,
                           SCALE_BK: tl.constexpr, HAS_BIAS: tl.constexpr):
    # W8A8 with block scales: out[m, n] = sum over the K steps of (xq[m, step] . w[n, step]) times the
    # input row's scale for the step's columns and the weight block's scale, each step's product added in
    # float32 (the scales change along K). The input rows on the tensor cores' wide side: with many rows,
    # the weight is read once per block of 64 of them. Program p: its input row block the fastest, so that
    # the programs sharing a weight row block run together.
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(M, BLOCK_M)
    n_block = pid // m_blocks
    m = (pid % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)
    m_mask, row_mask = m < M, rows < N
    x_rows = xq_ptr + m.to(tl.int64)[:, None] * x_stride
    w_cols = w_ptr + rows.to(tl.int64)[None, :] * w_stride
    xs_rows = xs_ptr + m * xs_stride
    s_row = s_ptr + (n_block * BLOCK_N // SCALE_BN) * s_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + c
        xq = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=(kk < K)[:, None] & row_mask[None, :], other=0.0)
        scale = tl.load(xs_rows + k0 // SCALE_BK, mask=m_mask, other=0.0) * tl.load(s_row + k0 // SCALE_BK)
        acc += tl.dot(xq, w) * scale[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m.to(tl.int64)[:, None] * out_stride + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & row_mask[None, :])


def fp8_block_gemm(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   bias: torch.Tensor | None = None, tile: Fp8GemmTile | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] FP8 * block scale)^T (+ bias) in x's dtype, W8A8: x quantized per row and
    block of columns (`quantize_rows(x, block[1])`)."""
    M, K = x.shape
    N = weight.shape[0]
    check_weight("fp8_block_gemm", K, weight, scale, block)
    tile = tile or gemm_tile(block, M)
    if tile is None or block[0] % tile.block_n or block[1] % tile.block_k:
        raise ValueError(f"fp8_block_gemm: {tile} does not fit within scale blocks of {block}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    xq, x_scale = quantized_rows(x, block[1])
    grid = (triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n),)
    _fp8_block_gemm_kernel[grid](
        xq, x_scale, weight, scale, bias if bias is not None else out, out, M, N, K, xq.stride(0),
        x_scale.stride(0), weight.stride(0), scale.stride(0), out.stride(0), BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages, SCALE_BN=block[0],
        SCALE_BK=block[1], HAS_BIAS=bias is not None, num_warps=tile.num_warps)
    return out
