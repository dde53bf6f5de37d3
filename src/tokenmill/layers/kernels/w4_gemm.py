"""W4A16 products: x [M, K] (16-bit or float32) times a 4-bit weight in `quantized.repack_w4`'s layout
(`qweight` int32 [N, K/8], input 8j + i of row n in field i of word j; `scales` fp16 and `zeros` uint8
[N, groups]). `w4_linear` is the entry point; the reference is `quantized.dequantize_w4` followed by
a plain matmul.

Few rows (M <= GEMV_ROWS, decode): `_w4_gemv_kernel`, one program per block of output rows walking
their whole K, the next chunk's words loaded while the current one is summed, like the bf16
single-token products (`gemv.py`); batch-1 decode is bound by these bytes, so the loop must cost
only a few instructions per weight. A thread holds a quad of four consecutive words (one 16-byte
load, inside one group) of each of its rows and the 32 inputs of the quad (four 16-byte loads,
shared by the rows), and every tensor of the loop has those lanes: no data moves between threads.
A nibble becomes a float with one and, no shift and no int-to-float conversion: kept in place at
bit p of its word (fields 5-7 after one shift of the word by 16), its bits read as the subnormal
q 2^(p-149), and with x scaled by 2^(64-p) every product is q x 2^-85; per quad and row
  sum_k (q_k - z) x_k s = (s 2^85) sum_k f_k x'_k - (s z) sum_k x_k,
so a weight costs one and one FMA per x row, the scale and zero two FMAs per quad and row. Exact
for |x| < 2^64; products below 2^-41 in size are rounded to a multiple of 2^-64, far below bf16's
resolution of the sum. (Subnormals are kept: Triton's float32 FMA does not flush them.)

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
    """`_w4_gemv_kernel`: a program sums block_n output rows, block_w words (8 inputs each) a chunk, four
    consecutive words of a row per thread: block_w is 128 words per warp."""
    block_n: int
    block_w: int
    num_warps: int

    def __post_init__(self):
        if self.block_w != 128 * self.num_warps:
            raise ValueError(f"{self}: block_w must be 128 words per warp (every thread four words)")


@dataclass(frozen=True)
class W4DequantTile:
    """`_w4_dequant_kernel`: a program writes block_n rows of 8 block_w dequantized weights."""
    block_n: int
    block_w: int
    num_warps: int


DEQUANT_TILE = W4DequantTile(block_n=8, block_w=128, num_warps=4)     # 8 KB of bf16 a program


# one-row tiles timed inside the batch-1 decode graph where the rule below lost (scripts/device/decode_tiles.py
# --weights awq, docs/BENCHMARKS.md): nanbeige4.1-3b's down_proj at 4 rows a program, where qwen3-4b's
# (K = 9,728) is faster at the rule's 8
ONE_ROW_TILES = {(2560, 10496): W4GemvTile(block_n=4, block_w=512, num_warps=4)}


def gemv_tile(n: int, k: int, m: int, device: torch.device) -> W4GemvTile:
    """Measured on an H200 (docs/BENCHMARKS.md, W4A16 products and "W4 GEMV at one row"): products of up to
    8192 rows take four warps a program, a row's K in chunks of 512 words, at one input row and wherever K
    is long (>= 8192), where many warps per program hide the loads' latency that few programs per SM leave
    exposed; 8 rows a program, or 4 at one row where K is shorter and 8-row programs would leave an SM
    fewer than three (both models' o_proj; their qkv, with more programs, are faster at 8). Otherwise a
    chunk of 128 words a row per warp, two warps where N is narrow so that the whole GPU still has about
    40 KB of weights in flight per SM (this chunk and the next), and 8 rows a program (they share each
    thread's inputs; 16 spill registers at 4 rows) while every SM still gets about four programs, else 4."""
    if m == 1 and (n, k) in ONE_ROW_TILES:
        return ONE_ROW_TILES[(n, k)]
    sms = _num_sms(device)
    if n <= 8192 and (m == 1 or k >= 8192):
        few = m == 1 and k < 8192 and triton.cdiv(n, 8) < 3 * sms
        return W4GemvTile(block_n=4 if few else 8, block_w=512, num_warps=4)
    warps = 1 if n * 128 * 4 * 2 >= 40 * 1024 * sms else 2
    block_n = 8 if triton.cdiv(n, 8) >= 4 * sms else 4
    return W4GemvTile(block_n=block_n, block_w=128 * warps, num_warps=warps)


def _num_sms(device: torch.device) -> int:
    from tokenmill.layers.kernels.gemv import _num_sms
    return _num_sms(device)


@triton.jit
def _split4(t):
    # [..., 4] held by one thread -> its four [...] slices, in order
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _split8(t):
    # [..., 8] held by one thread -> its eight [...] slices, in order
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    t0, t4 = tl.split(a0)
    t2, t6 = tl.split(a1)
    t1, t5 = tl.split(b0)
    t3, t7 = tl.split(b1)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _nib(bits, p: tl.constexpr):
    # the nibble at bits p..p+3 kept in place, read as a float: q * 2^(p - 149), exact (a subnormal)
    return (bits & (0xF << p)).to(tl.float32, bitcast=True)


@triton.jit
def _word_row(w, hi, x_row, x_ok, xw, K: tl.constexpr, i, dot):
    # dot [BQ, BN] += 2^-85 sum_i q_i x_i over one word per (quad, row), inputs x_row[8 xw + i]; returns
    # it and sum_i x_i [BQ]. Field i sits at bit 4i (i <= 4) of the word or 4i - 16 of hi; x_i is scaled
    # by 2^(64 - that bit), so every product is q x 2^-85
    xv = tl.load(x_row + xw[:, None] * 8 + i[None, :], mask=(xw * 8 < K)[:, None] & x_ok, other=0.0).to(tl.float32)
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(xv)
    dot += _nib(w, 0) * (x0 * 2.0 ** 64)[:, None]
    dot += _nib(w, 4) * (x1 * 2.0 ** 60)[:, None]
    dot += _nib(w, 8) * (x2 * 2.0 ** 56)[:, None]
    dot += _nib(w, 12) * (x3 * 2.0 ** 52)[:, None]
    dot += _nib(w, 16) * (x4 * 2.0 ** 48)[:, None]
    dot += _nib(hi, 4) * (x5 * 2.0 ** 60)[:, None]
    dot += _nib(hi, 8) * (x6 * 2.0 ** 56)[:, None]
    dot += _nib(hi, 12) * (x7 * 2.0 ** 52)[:, None]
    return dot, tl.sum(xv, 1)


@triton.jit
def _quad_row(w0, w1, w2, w3, x_ptr, x_stride, M, wq, K: tl.constexpr, i, a, b, acc, r: tl.constexpr):
    # x row r's share of a chunk (zero past M): per (quad, row) the four words' 2^-85 sum q x, then
    # acc += s 2^85 (that) - s z (sum x)   (a = s 2^85, b = s z)
    x_row = x_ptr + r * x_stride
    x_ok = r < M
    dot = tl.zeros(acc.shape, tl.float32)
    dot, x0 = _word_row(w0, _hi(w0), x_row, x_ok, wq, K, i, dot)
    dot, x1 = _word_row(w1, _hi(w1), x_row, x_ok, wq + 1, K, i, dot)
    dot, x2 = _word_row(w2, _hi(w2), x_row, x_ok, wq + 2, K, i, dot)
    dot, x3 = _word_row(w3, _hi(w3), x_row, x_ok, wq + 3, K, i, dot)
    return acc + a * dot - b * ((x0 + x1) + (x2 + x3))[:, None]


@triton.jit
def _hi(w):
    return (w.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)


@triton.jit
def _store_row(out_ptr, acc, rows, row_ok, b_ptr, M, out_stride, r: tl.constexpr, HAS_BIAS: tl.constexpr):
    y = tl.sum(acc, 0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * out_stride + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok & (r < M))


@triton.jit
def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, x_stride, out_stride,
                    K: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    # program p: output features p*BLOCK_N .. +BLOCK_N of the M <= ROWS (<= 4) input rows. Tiles are
    # [quads, rows]: a thread holds four consecutive words (a quad, one 16-byte load, within one group
    # since groups are multiples of 32 inputs) of each of the BLOCK_N rows, and the 8 inputs of each
    # of those words (16-byte loads), shared by the rows; every other tensor has the same lanes, so
    # nothing moves between threads until the last sum. One accumulator per x row, [quads, rows].
    KW: tl.constexpr = K // 8
    BQ: tl.constexpr = BLOCK_W // 4
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    q = tl.arange(0, BQ)
    v = tl.arange(0, 4)
    i = tl.arange(0, 8)
    w_rows = w_ptr + rows.to(tl.int64)[None, :, None] * KW
    wv = 4 * q[:, None, None] + v[None, None, :]
    # weights never change: the first chunk is requested before waiting for the kernel before
    words = tl.load(w_rows + wv, mask=row_ok[None, :, None] & (wv < KW), other=0, cache_modifier=".cg")
    pdl.enter(PDL)
    acc0 = tl.zeros([BQ, BLOCK_N], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for w0 in tl.range(0, KW, BLOCK_W, num_stages=1):
        wq = w0 + 4 * q
        nv = wv + (w0 + BLOCK_W)        # the next chunk's words, in flight while this one is summed
        nxt = tl.load(w_rows + nv, mask=row_ok[None, :, None] & (nv < KW), other=0, cache_modifier=".cg")
        g = rows[None, :] * GROUPS + (wq * 8 // GROUP)[:, None]
        g_ok = row_ok[None, :] & (wq < KW)[:, None]
        s = tl.load(s_ptr + g, mask=g_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g, mask=g_ok, other=0).to(tl.float32)
        a = s * 2.0 ** 85
        b = s * z
        w0_, w1_, w2_, w3_ = _split4(words)
        acc0 = _quad_row(w0_, w1_, w2_, w3_, x_ptr, x_stride, M, wq, K, i, a, b, acc0, 0)
        if ROWS > 1:
            acc1 = _quad_row(w0_, w1_, w2_, w3_, x_ptr, x_stride, M, wq, K, i, a, b, acc1, 1)
        if ROWS > 2:
            acc2 = _quad_row(w0_, w1_, w2_, w3_, x_ptr, x_stride, M, wq, K, i, a, b, acc2, 2)
            acc3 = _quad_row(w0_, w1_, w2_, w3_, x_ptr, x_stride, M, wq, K, i, a, b, acc3, 3)
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
    tile = tile or gemv_tile(n, k, m, x.device)
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
