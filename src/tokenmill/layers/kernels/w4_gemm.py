"""W4A16 products: x [M, K] (16-bit or float32) times a 4-bit weight in `quantized.repack_w4`'s layout
(`qweight` int32 [N, K/8], input 8j + i of row n in field i of word j; `scales` fp16 and `zeros` uint8
[N, groups]), dequantized in registers, accumulated in float32. `w4_linear` is the entry point; the
reference is `quantized.dequantize_w4` followed by a plain matmul.

Few rows (M <= GEMV_ROWS, decode): `_w4_gemv_kernel`, one program per block of output rows walking
their whole K, the next chunk's words loaded while the current one is summed, like the bf16
single-token products (`gemv.py`); batch-1 decode is bound by these bytes. Each nibble becomes a float
without an int-to-float conversion (a quarter-rate instruction that would bound the kernel below HBM
speed): put into mantissa bits 16..19 of 1.0f it reads 1 + q/128, so per group and row
  sum_k (q_k - z) x_k = 128 sum_k f_k x_k - (128 + z) sum_k x_k    with f_k = 1 + q_k/128,
one shift, one and-or and one FMA per weight; both terms are near |x| in size, so nothing cancels
catastrophically in float32.

More rows (prefill, larger batches): `dequantize` writes W in x's dtype into a scratch with
`_w4_dequant_kernel` (4-bit words in, 16-bit weights out, at copy speed) and cuBLAS multiplies it. A
tensor-core GEMM that dequantizes each tile in registers reads fewer bytes, but it moves the nibbles
into the MMA operand layouts tile by tile and stays far from this path's cost, which is cuBLAS's plus
one write of the 16-bit weight. The product is exactly the torch reference's: W rounded to x's dtype,
accumulated by cuBLAS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.layers.kernels import pdl

GEMV_ROWS = 4          # up to this many rows, one GEMV reads the weights once for all of them


@dataclass(frozen=True)
class W4GemvTile:
    """`_w4_gemv_kernel`: a program sums block_n output rows, block_w words (8 inputs each) a chunk."""
    block_n: int
    block_w: int
    num_warps: int


@dataclass(frozen=True)
class W4DequantTile:
    """`_w4_dequant_kernel`: a program writes block_n rows of 8 block_w dequantized weights."""
    block_n: int
    block_w: int
    num_warps: int


DEQUANT_TILE = W4DequantTile(block_n=8, block_w=128, num_warps=4)     # 8 KB of bf16 a program


def gemv_tile(n: int, k: int, device: torch.device) -> W4GemvTile:
    """The fewest rows per program that still give every SM about four programs, so a product of a
    narrow weight (N = hidden) fills the GPU without splitting K; 1024 words (4 KB) a chunk."""
    programs = 4 * _num_sms(device)
    block_n = 16
    while block_n > 2 and triton.cdiv(n, block_n) < programs:
        block_n //= 2
    return W4GemvTile(block_n=block_n, block_w=min(1024 // block_n, triton.next_power_of_2(k // 8)), num_warps=4)


def _num_sms(device: torch.device) -> int:
    from tokenmill.layers.kernels.gemv import _num_sms
    return _num_sms(device)


@triton.jit
def _field(words, i: tl.constexpr):
    # field i (bits 4i..4i+3) of each word moved to mantissa bits 16..19 of 1.0f: the float 1 + q/128
    if 4 * i < 16:
        t = words << (16 - 4 * i)
    elif 4 * i > 16:
        t = words >> (4 * i - 16)
    else:
        t = words
    return ((t & 0xF0000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _row_chunk(words, x_row, jj, w_ok, s, zc, M, r: tl.constexpr):
    # row r's share of a chunk, per word: s (sum_i (q_i - z) x_i) over the word's eight inputs 8jj + i
    # (zc = z + 128, see the module docstring); zero for a row past M
    x_ok = w_ok & (r < M)
    dot = tl.zeros(words.shape, tl.float32)
    xs = tl.zeros(jj.shape, tl.float32)
    for i in tl.static_range(8):
        xi = tl.load(x_row + jj * 8 + i, mask=x_ok, other=0.0).to(tl.float32)
        xs += xi
        dot += _field(words, i) * xi[None, :]
    return s * (128.0 * dot - zc * xs[None, :])


@triton.jit
def _store_row(out_ptr, acc, rows, row_ok, b_ptr, M, out_stride, r: tl.constexpr, HAS_BIAS: tl.constexpr):
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * out_stride + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok & (r < M))


@triton.jit
def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, x_stride, out_stride,
                    K: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    # program p: output features p*BLOCK_N .. +BLOCK_N of the M <= ROWS (<= 4) input rows; one
    # accumulator per row, each [BLOCK_N, BLOCK_W] per word until the end
    KW: tl.constexpr = K // 8
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    j = tl.arange(0, BLOCK_W)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * KW
    sz_rows = rows[:, None] * GROUPS
    # weights never change: the first chunk is requested before waiting for the kernel before
    words = tl.load(w_rows + j[None, :], mask=row_ok[:, None] & (j < KW)[None, :], other=0, cache_modifier=".cg")
    pdl.enter(PDL)
    acc0 = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for w0 in tl.range(0, KW, BLOCK_W, num_stages=1):
        jj = w0 + j
        w_ok = jj < KW
        ok = row_ok[:, None] & w_ok[None, :]
        nj = jj + BLOCK_W       # the next chunk's words, in flight while this one is summed
        nxt = tl.load(w_rows + nj[None, :], mask=row_ok[:, None] & (nj < KW)[None, :], other=0,
                      cache_modifier=".cg")
        g = sz_rows + (jj * 8 // GROUP)[None, :]
        s = tl.load(s_ptr + g, mask=ok, other=0.0).to(tl.float32)
        zc = tl.load(z_ptr + g, mask=ok, other=0).to(tl.float32) + 128.0
        acc0 += _row_chunk(words, x_ptr, jj, w_ok, s, zc, M, 0)
        if ROWS > 1:
            acc1 += _row_chunk(words, x_ptr + x_stride, jj, w_ok, s, zc, M, 1)
        if ROWS > 2:
            acc2 += _row_chunk(words, x_ptr + 2 * x_stride, jj, w_ok, s, zc, M, 2)
            acc3 += _row_chunk(words, x_ptr + 3 * x_stride, jj, w_ok, s, zc, M, 3)
        words = nxt
    _store_row(out_ptr, acc0, rows, row_ok, b_ptr, M, out_stride, 0, HAS_BIAS)
    if ROWS > 1:
        _store_row(out_ptr, acc1, rows, row_ok, b_ptr, M, out_stride, 1, HAS_BIAS)
    if ROWS > 2:
        _store_row(out_ptr, acc2, rows, row_ok, b_ptr, M, out_stride, 2, HAS_BIAS)
        _store_row(out_ptr, acc3, rows, row_ok, b_ptr, M, out_stride, 3, HAS_BIAS)


@triton.jit
def _w4_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K: tl.constexpr, GROUPS: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    # program (pid_n, pid_w): W[rows, 8 BLOCK_W inputs] = (q - z) * s in float32, rounded once to the
    # output's dtype (as `dequantize_w4(...).to(dtype)` rounds it); stored as whole rows of 16-byte
    # vectors, one word's eight values a thread
    KW: tl.constexpr = K // 8
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    jj = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    i = tl.arange(0, 8)
    ok = (rows < N)[:, None] & (jj < KW)[None, :]
    words = tl.load(w_ptr + rows.to(tl.int64)[:, None] * KW + jj[None, :], mask=ok, other=0)
    g = rows[:, None] * GROUPS + (jj * 8 // GROUP)[None, :]
    s = tl.load(s_ptr + g, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g, mask=ok, other=0).to(tl.int32)
    # the weights' previous writer is the kernel before only when the scratch is reused: wait first
    pdl.enter(PDL)
    q = (words[:, :, None] >> (4 * i)[None, None, :]) & 0xF
    w = ((q - z[:, :, None]).to(tl.float32) * s[:, :, None]).to(out_ptr.dtype.element_ty)
    cols = tl.program_id(1) * BLOCK_W * 8 + tl.arange(0, BLOCK_W * 8)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], tl.reshape(w, [BLOCK_N, BLOCK_W * 8]),
             mask=(rows < N)[:, None] & (cols < K)[None, :])


def _check(x, qweight, scales, zeros, bias, group_size):
    n, kw = qweight.shape
    k = kw * 8
    groups = -(-k // group_size)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"w4_linear: x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"w4_linear: x must be float16, bfloat16 or float32, got {x.dtype}")
    if qweight.dtype != torch.int32 or not qweight.is_contiguous():
        raise ValueError("w4_linear: qweight must be contiguous int32 [N, K/8]")
    if scales.shape != (n, groups) or scales.dtype != torch.float16 or not scales.is_contiguous():
        raise ValueError(f"w4_linear: scales must be contiguous float16 [{n}, {groups}], got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if zeros.shape != (n, groups) or zeros.dtype != torch.uint8 or not zeros.is_contiguous():
        raise ValueError(f"w4_linear: zeros must be contiguous uint8 [{n}, {groups}], got "
                         f"{zeros.dtype} {tuple(zeros.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"w4_linear: bias must be [{n}], got {tuple(bias.shape)}")
    return n, k, groups


def w4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              bias: torch.Tensor | None, group_size: int, tile: W4GemvTile | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W given as `repack_w4`'s tensors. M <=
    GEMV_ROWS rows run the GEMV (`tile` overrides its shipped tile), more dequantize W into a scratch
    in x's dtype and multiply it with torch (cuBLAS). No host synchronisation; the output and the
    scratch come from torch's caching allocator, so under CUDA-graph capture both live in the graph's
    pool at fixed addresses, and a scratch freed after its product is reused by the next layer's."""
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    n, k, groups = _check(x, qweight, scales, zeros, bias, group_size)
    m = x.shape[0]
    if m > GEMV_ROWS:
        if tile is not None:
            raise TypeError(f"w4_linear: {m} rows dequantize and run cuBLAS, which takes no tile")
        return F.linear(x, dequantize(qweight, scales, zeros, group_size, x.dtype), bias).reshape(*lead, n)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    pdl_on = pdl.enabled(x.device)
    tile = tile or gemv_tile(n, k, x.device)
    _w4_gemv_kernel[(triton.cdiv(n, tile.block_n),)](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, m, n, x.stride(0), out.stride(0),
        K=k, GROUPS=groups, GROUP=group_size, ROWS=1 if m == 1 else 2 if m == 2 else 4, BLOCK_N=tile.block_n,
        BLOCK_W=tile.block_w, HAS_BIAS=bias is not None, PDL=pdl_on, num_warps=tile.num_warps, launch_pdl=pdl_on)
    return out.reshape(*lead, n)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` from `repack_w4`'s tensors, equal to `dequantize_w4(...).to(dtype)`: one pass
    that reads the 4-bit weights and writes the dense ones at copy speed."""
    n, kw = qweight.shape
    k = kw * 8
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    pdl_on = pdl.enabled(qweight.device)
    grid = (triton.cdiv(n, DEQUANT_TILE.block_n), triton.cdiv(kw, DEQUANT_TILE.block_w))
    _w4_dequant_kernel[grid](qweight, scales, zeros, out, n, K=k, GROUPS=-(-k // group_size), GROUP=group_size,
                             BLOCK_N=DEQUANT_TILE.block_n, BLOCK_W=DEQUANT_TILE.block_w, PDL=pdl_on,
                             num_warps=DEQUANT_TILE.num_warps, launch_pdl=pdl_on)
    return out
