"""Products with FP8 weights (`layers/fp8_linear.Fp8Linear`): `fp8_linear` picks one path per batch shape.

A step of one token does not come here: its layers run the single-token products of `gemv.py`, which
read the FP8 weights with their scales and fold the norms and SiLU-and-mul in, as for 16-bit weights.

All paths but the last are W8A8: each input row is quantized to FP8 (`fp8_quantize.quantize_rows`: absmax / 448 of the
row, or with block scales of each row's block of columns, as the checkpoints' dynamic scheme has it) and
the products run on the FP8 tensor cores. The kernel that writes a product's input may quantize it on its
way out instead (`Fp8Rows`; `input_group` says with which columns per scale): the RMSNorm before qkv and
gate_up and the SiLU-and-mul before down do, saving a kernel and a round trip of the rows a product, and,
beside an FP8 KV cache, the attention kernels before o_proj, at V's scale (`attention_common.out_rows`).

- Per-channel weights no wider than deep (o_proj, down_proj) at up to `TENSORWISE_MAX_ROWS` input rows:
  `torch._scaled_mm` with scalar scales (cuBLASLt, whose kernels split K on these shapes) into float32,
  then `_scale_rows_kernel` (each row's and each channel's scale, the bias, the cast). With the row and channel
  scales in the call (PyTorch's rowwise kernel) down_proj took ~26 us from 64 to 512 rows on an H200, and
  13-21 us this way at 64-384 rows (1.2-1.5x faster than `fp8_rows` at 64-128). Below 64 rows the decode
  graph of qwen3-4b (FP8 weights and KV) on an H100 took 0.84x the time with o_proj and down this way
  rather than on `fp8_rows` at 48 sequences, 0.94-0.97x at 2, 8, 16 and 32, 1.02x at 4
  (docs/BENCHMARKS.md). Wider products (qkv, gate_up) lose it to the float32 round trip.
- A product whose next kernel applies the scales as it loads it (`unscaled`: o_proj and down_proj into the
  RMSNorm that adds the residual, gate_up into SiLU-and-mul, qkv into the attention prologue of the steps
  that are not one-kernel decodes; `quant/fp8.UnscaledRows`), per channel,
  without a bias: the same `_scaled_mm` with scalar scales, and no kernel of its own to scale it. Narrow
  ones up to `UNSCALED_NARROW_MAX_ROWS` rows, wide ones within `UNSCALED_WIDE_ROWS` (at 64 rows and fewer
  `fp8_rows` wins). qwen3-4b's 128- and 192-token mixed graphs took 0.968x and 0.910x the time with the
  wide products this way (FP8 weights and KV, 64 sequences, one H100). On an H100 (sums in bfloat16) it
  took 0.72-0.89x the time of the rowwise `_scaled_mm` for o_proj and down at 512, 1,024 and 2,048 rows
  (0.95-1.00x at 768), 0.72-0.91x `fp8_rows`' for gate_up at 96-192 rows. Past 192 rows gate_up keeps the
  rowwise `_scaled_mm`: its own time is 0.93-0.95x at 256-384 rows this way, but the 384-token mixed graphs
  took 1.016-1.020x the time with it, SiLU-and-mul reading each gate and up column's scale again for every
  row (docs/BENCHMARKS.md).
- Up to `ROWS_MAX` input rows per channel (decode batches, and the mixed steps of a few dozen
  requests), up to `BLOCK_GEMM_ROWS` with block scales: `_fp8_rows_kernel`, the weight rows on the tensor
  cores' wide side and the input rows, in blocks of 64, on the narrow one, the K steps split over enough
  programs to fill the SMs. Per channel, at up to `EARLY_ROWS` input rows, each program reads its first
  four weight steps before its programmatic-dependent-launch wait, while the kernel before it runs: the
  decode graph of qwen3-4b (FP8 weights and KV) at 4-32 sequences took 0.86-0.89x the time on an H100
  (nanbeige4.1-3b's 0.90-0.94x), o_proj and down among these products then; at 64 rows and in 128-token
  mixed steps it took 1.01-1.09x, the registers that hold the steps being short there (docs/BENCHMARKS.md).
  On an H200, per channel, it took 0.03-0.89x the time of `quantize_rows` + `_scaled_mm` at 2-64 rows,
  0.71-1.02x at 128-192 (0.85-0.86x over a layer's four products), 1.12-1.38x over a layer at 256-512, and
  0.57-0.93x bf16's at 2-16 (qwen3-4b shapes, docs/BENCHMARKS.md).
- More rows, per-channel scales: `torch._scaled_mm` with the weight's per-channel scales; there the
  products are bound by compute, which FP8 doubles.
- Both `_scaled_mm` paths accumulate fast (`use_fast_accum`: the tensor cores' partial sums are not
  promoted to float32 every few K steps), as the Triton kernels here do on sm90 (Triton's default for FP8
  dots there) and vLLM's sm90 CUTLASS FP8 kernels do. It adds 1-3e-3 of an output's root mean square,
  against the 3.5e-2 that the FP8 operands already cost, and took 0.83-0.94x the time on most shapes
  from 128 to 2,048 rows on an H200 (docs/BENCHMARKS.md).
- More rows, block scales: `fp8_block_gemm` (its own file), the input rows on the wide side, each K step's
  product scaled in float32. The rowwise `_scaled_mm` cannot apply a scale that changes along K. Over a
  layer of qwen3-4b it took 0.56-0.79x `fp8_rows`' time at 64-8,192 rows; dequantizing the layer for
  each product cost 120-520 us a product.
- Block scales that no tile fits (blocks not a multiple of 16 weight rows and 32 columns): the layer
  dequantized to the activation dtype and multiplied there.

`fp8_linear_torch` (dequantize, then `F.linear`) is the reference the kernels are tested against.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.layers.kernels import pdl, split_k
from tokenmill.layers.kernels.fp8_block_gemm import WIDE_TILE_ROWS, fp8_block_gemm, gemm_tile
from tokenmill.layers.kernels.fp8_quantize import check_weight, quantized_rows
from tokenmill.layers.kernels.gemv import _num_sms
from tokenmill.quant.fp8 import Fp8Rows, UnscaledRows, dequantize

ROWS_MAX = 192
TENSORWISE_MAX_ROWS = 384     # narrow per-channel products of up to these input rows take `fp8_linear_tensorwise`
UNSCALED_NARROW_MAX_ROWS = 2048   # `unscaled` narrow products of up to these rows come before their scales
UNSCALED_WIDE_ROWS = (64, ROWS_MAX)   # `unscaled` wide products of more than the first, at most the second
ROWS_BLOCK_M = 64      # input rows a tile of `_fp8_rows_kernel` takes, at most
ROWS_BLOCK_M_MIN = 16  # and at least (tl.dot takes no side under 16)
EARLY_ROWS, EARLY_STEPS = 32, 4     # per-channel products of at most EARLY_ROWS input rows read EARLY_STEPS
                                    # weight steps before their wait (`rows_tile`)
BLOCK_GEMM_ROWS = 32   # block-scaled products of more input rows take `fp8_block_gemm`
HALF_SPLIT_ROWS = ROWS_BLOCK_M // 2     # per-channel products of more input rows halve their K split (`rows_tile`)
# every row count above which `fp8_linear` may take another path, tile or kernel specialization (input rows
# padded to 16, 32, 64; a third block of 64 rows; the bounds above): an engine warms one eager step just above
# each that its CUDA graphs do not hold (`ModelRunner._warm_eager`), so that none compiles in a served step
PATH_ROWS = (ROWS_BLOCK_M_MIN, BLOCK_GEMM_ROWS, ROWS_BLOCK_M, 2 * ROWS_BLOCK_M, ROWS_MAX, TENSORWISE_MAX_ROWS,
             WIDE_TILE_ROWS - 1, UNSCALED_NARROW_MAX_ROWS)


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: x @ (weight * block scale)^T (+ bias), the weight dequantized in float32, then cast to x's
    dtype."""
    return F.linear(x, dequantize(weight, scale, block).to(x.dtype), bias)


@dataclass(frozen=True)
class Fp8RowsTile:
    """`_fp8_rows_kernel`: a program multiplies block_n weight rows by up to block_m input rows (padded to a
    power of two of at least 16) on the tensor cores, walking K in block_k steps with num_stages of them
    in flight; split_k programs share a tile's K steps."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int
    block_m: int = ROWS_BLOCK_M
    early_steps: int = 0        # weight steps read before the programmatic-dependent-launch wait: 0 or 4


@functools.lru_cache(maxsize=None)
def input_group(shape: tuple[int, int], block: tuple[int, int], device: torch.device) -> int | None:
    """The columns per activation scale with which every path of `fp8_linear` quantizes the input rows of
    a weight of `shape` [N, K], at any row count (K for per-channel scales, the scale block's width for
    block scales), so that their producer may quantize them (`Fp8Rows`); None where some path takes them
    unquantized (the dequantized layer). Cached: the decoder asks for each layer on each eager step."""
    n, k = shape
    if block == (1, k):
        return k if scaled_mm_fits(shape, block) else None
    return block[1] if rows_tile(n, block, device) is not None and gemm_tile(block) is not None else None


def rows_tile(n: int, block: tuple[int, int], device: torch.device, m: int = 1) -> Fp8RowsTile | None:
    """The tile of an n-row weight with scale blocks `block` ((1, K) per channel) for m input rows, or
    None where block scales admit none: 64 weight rows (the tensor cores' narrowest side with FP8) by 128
    columns, fewer where a block is smaller, four steps in flight, input rows in blocks of 64, and the K
    steps split so that the tiles' programs fill the SMs about once. Per channel, where the tiles of one
    block of input rows fit in one wave of the SMs, 256-column steps (three in flight) halve the steps
    that each wait for their product; and more than `HALF_SPLIT_ROWS` input rows take half that split, as
    their partial sums grow with the rows while the split's reach over the SMs does not. (On an H200, of
    24 tiles a product: the fastest or within 2% of it at 16 and 64 rows, within 17% at 128-192.)"""
    block_n, block_k, stages = 64, 128, 4
    per_channel = block[0] == 1
    if not per_channel:
        block_n = next((b for b in (64, 32, 16) if block[0] % b == 0), None)
        block_k = next((b for b in (128, 64, 32) if block[1] % b == 0), None)
        if block_n is None or block_k is None:
            return None
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, ROWS_BLOCK_M)
    sms = _num_sms(device)
    if per_channel and m <= ROWS_BLOCK_M and tiles <= sms:
        block_k, stages = 256, 3
    split = max(1, triton.cdiv(sms, tiles))
    if per_channel and m > HALF_SPLIT_ROWS:
        split = max(1, split // 2)
    early = EARLY_STEPS if per_channel and m <= EARLY_ROWS else 0
    return Fp8RowsTile(block_n, block_k, 4, stages, split, early_steps=early)


# M unspecialized: an eager step of any row count reuses the variant that a CUDA graph of the same tile
# compiled (input rows in blocks of 64, as per-channel products of 65-192 rows run)
@triton.jit(do_not_specialize=["M"])
def _fp8_rows_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, x_stride,
                     xs_stride, w_stride, s_stride, out_stride, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                     BLOCK_SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                     HAS_BIAS: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    # W8A8: out[m, n] = sum over k of xq[m, k] * w[n, k] times the scales of (m, k) and (n, k), as
    # tl.dot(w [BLOCK_N, BLOCK_K], xq^T [BLOCK_K, BLOCK_M]) so that the weight rows fill the tensor cores'
    # 64-row side and the input rows the narrow one. Program (p, s): tile p (its input row blocks the
    # fastest, so that the programs sharing a weight row block run together and read it once from HBM),
    # split s of the K steps (`split_k`).
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(M, BLOCK_M)
    n_block = pid // m_blocks
    rows = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (pid % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_K)
    row_mask, m_mask = rows < N, m < M
    k_begin, k_end = split_k.k_range(K, BLOCK_K, SPLIT)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_stride
    x_cols = xq_ptr + m.to(tl.int64)[None, :] * x_stride
    # programmatic dependent launch (`pdl.py`): the programs launch while the kernel before them runs. With
    # EARLY (per channel, few input rows: registers to spare) they read their split's first four weight
    # steps then, which no kernel of the forward pass writes, and multiply them once their input is ready
    if EARLY:
        k1 = k_begin + c
        k2, k3, k4 = k1 + BLOCK_K, k1 + 2 * BLOCK_K, k1 + 3 * BLOCK_K
        w1 = tl.load(w_rows + k1[None, :], mask=row_mask[:, None] & (k1 < k_end)[None, :], other=0.0)
        w2 = tl.load(w_rows + k2[None, :], mask=row_mask[:, None] & (k2 < k_end)[None, :], other=0.0)
        w3 = tl.load(w_rows + k3[None, :], mask=row_mask[:, None] & (k3 < k_end)[None, :], other=0.0)
        w4 = tl.load(w_rows + k4[None, :], mask=row_mask[:, None] & (k4 < k_end)[None, :], other=0.0)
    pdl.enter(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if EARLY:
        acc += tl.dot(w1, tl.load(x_cols + k1[:, None], mask=(k1 < k_end)[:, None] & m_mask[None, :], other=0.0))
        acc += tl.dot(w2, tl.load(x_cols + k2[:, None], mask=(k2 < k_end)[:, None] & m_mask[None, :], other=0.0))
        acc += tl.dot(w3, tl.load(x_cols + k3[:, None], mask=(k3 < k_end)[:, None] & m_mask[None, :], other=0.0))
        acc += tl.dot(w4, tl.load(x_cols + k4[:, None], mask=(k4 < k_end)[:, None] & m_mask[None, :], other=0.0))
    for k0 in tl.range(k_begin + EARLY * BLOCK_K, k_end, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + c
        w = tl.load(w_rows + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
        xq = tl.load(x_cols + kk[:, None], mask=(kk < K)[:, None] & m_mask[None, :], other=0.0)
        # each step's product added in float32: Hopper's FP8 tensor cores accumulate with fewer bits
        step = tl.dot(w, xq)
        if BLOCK_SCALE:   # a row block lies within one scale row and a step within one scale column
            step *= tl.load(s_ptr + (n_block * BLOCK_N // SCALE_BN) * s_stride + k0 // SCALE_BK) * \
                tl.load(xs_ptr + m * xs_stride + k0 // SCALE_BK, mask=m_mask, other=0.0)[None, :]
        acc += step
    acc, out_mask = split_k.gather(acc, row_mask[:, None] & m_mask[None, :], part_ptr, count_ptr, rows, m, N,
                                   m_blocks * BLOCK_M, SPLIT)
    if not BLOCK_SCALE:
        acc *= tl.load(xs_ptr + m, mask=m_mask, other=0.0)[None, :] * \
            tl.load(s_ptr + rows * s_stride, mask=row_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + m.to(tl.int64)[None, :] * out_stride + rows[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=out_mask)


def rows_block_m(tile: Fp8RowsTile, m: int) -> int:
    """The input rows a program of `_fp8_rows_kernel` takes for m rows: m padded to a power of two of at least
    ROWS_BLOCK_M_MIN, at most the tile's block_m."""
    return min(tile.block_m, max(ROWS_BLOCK_M_MIN, triton.next_power_of_2(m)))


def fp8_rows(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
             bias: torch.Tensor | None = None, tile: Fp8RowsTile | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] FP8 * scale)^T (+ bias) in x's dtype, W8A8: x quantized per row
    (`quantize_rows`) for per-channel scales, per row and block of columns for block scales."""
    M, K = x.shape
    N = weight.shape[0]
    check_weight("fp8_rows", K, weight, scale, block)
    block_scale = block != (1, K)
    tile = tile or rows_tile(N, block, x.device, M)
    if tile is None or block_scale and (block[0] % tile.block_n or block[1] % tile.block_k):
        raise ValueError(f"fp8_rows: {tile} does not fit within scale blocks of {block}")
    if tile.early_steps not in (0, EARLY_STEPS) or tile.early_steps and block_scale:
        raise ValueError(f"fp8_rows: {tile} reads 0 or {EARLY_STEPS} weight steps before its wait, and none with "
                         f"block scales ({block})")
    if M == 0:
        return torch.empty(0, N, dtype=x.dtype, device=x.device)
    # block-scaled weights take one activation scale per row and block of columns (the checkpoints'
    # dynamic per-token-group scheme), per-channel ones one per row
    xq, x_scale = quantized_rows(x, block[1] if block_scale else K)
    block_m = rows_block_m(tile, M)
    m_blocks = triton.cdiv(M, block_m)
    blocks = triton.cdiv(N, tile.block_n) * m_blocks
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    part, count = split_k.scratch(x.device, tile.split_k, N, m_blocks * block_m, blocks)
    pdl_on = pdl.enabled(x.device)
    _fp8_rows_kernel[(blocks, tile.split_k)](
        xq, x_scale, weight, scale, bias if bias is not None else out, out, part, count, M, N, K, xq.stride(0),
        x_scale.stride(0), weight.stride(0), scale.stride(0), out.stride(0), SPLIT=tile.split_k,
        BLOCK_N=tile.block_n, BLOCK_M=block_m, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages, BLOCK_SCALE=block_scale,
        SCALE_BN=block[0], SCALE_BK=block[1], HAS_BIAS=bias is not None, EARLY=tile.early_steps, PDL=pdl_on,
        num_warps=tile.num_warps, launch_pdl=pdl_on)
    return out


def scaled_mm_fits(shape: tuple[int, int], block: tuple[int, int]) -> bool:
    """`torch._scaled_mm` with rowwise scales, for a weight of `shape` [N, K]: per-channel scales and both
    dims multiples of 16."""
    n, k = shape
    return block[1] == k and block[0] == 1 and n % 16 == 0 and k % 16 == 0


def tensorwise_fits(shape: tuple[int, int], block: tuple[int, int], rows: int) -> bool:
    """Whether `fp8_linear` takes `fp8_linear_tensorwise` for `rows` input rows and a weight of `shape`."""
    n, k = shape
    return scaled_mm_fits(shape, block) and n <= k and rows <= TENSORWISE_MAX_ROWS


def unscaled_fits(shape: tuple[int, int], block: tuple[int, int], rows: int) -> bool:
    """Whether `fp8_linear` with `unscaled` gives the product of `rows` input rows and a weight of `shape`
    before its scales: per channel, and narrow (no wider than deep) up to `UNSCALED_NARROW_MAX_ROWS` rows,
    wide within `UNSCALED_WIDE_ROWS`."""
    n, k = shape
    if not scaled_mm_fits(shape, block):
        return False
    if n <= k:
        return rows <= UNSCALED_NARROW_MAX_ROWS
    return UNSCALED_WIDE_ROWS[0] < rows <= UNSCALED_WIDE_ROWS[1]


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None, unscaled: bool = False) -> torch.Tensor | UnscaledRows:
    """x [T, K] @ W^T (+ bias) on CUDA, by the path of the module docstring; x may come quantized
    (`Fp8Rows`, with the group of `input_group`). `unscaled` (for a product whose next kernel applies the
    scales as it loads it: the RMSNorm after o_proj and down, SiLU-and-mul after gate_up, the attention
    prologue after qkv): without a bias and where `unscaled_fits`, the result comes before its scales
    (`fp8_linear_unscaled`)."""
    if x.shape[0] > BLOCK_GEMM_ROWS and block != (1, x.shape[1]):
        tile = gemm_tile(block, x.shape[0])
        if tile is not None:
            return fp8_block_gemm(x, weight, scale, block, bias, tile)
    elif unscaled and bias is None and unscaled_fits(tuple(weight.shape), block, x.shape[0]):
        return fp8_linear_unscaled(x, weight, scale)
    elif tensorwise_fits(tuple(weight.shape), block, x.shape[0]):
        return fp8_linear_tensorwise(x, weight, scale, bias)
    elif x.shape[0] <= ROWS_MAX or not scaled_mm_fits(weight.shape, block):
        tile = rows_tile(weight.shape[0], block, x.device, x.shape[0])
        if tile is not None:
            return fp8_rows(x, weight, scale, block, bias, tile)
    return fp8_linear_many(x, weight, scale, block, bias)


@functools.lru_cache(maxsize=None)
def _one(device: torch.device) -> torch.Tensor:
    # filled by a kernel, which a CUDA graph being captured would record instead of running: the first
    # call must be eager (the runner warms every graph up eagerly before capturing it)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("fp8_linear_tensorwise's first call on a device must run eagerly, not under capture")
    return torch.ones((), device=device)


def _raw_product(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, out_dtype: torch.dtype):
    """The per-channel product before its scales, in `out_dtype` (`_scaled_mm` with scalar scales of 1),
    and the input rows' scales."""
    xq, x_scale = quantized_rows(x, x.shape[1])
    one = _one(xq.device)
    raw = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=out_dtype, use_fast_accum=True)
    return raw, x_scale


def fp8_linear_unscaled(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor) -> UnscaledRows:
    """`fp8_linear` of a per-channel weight without a bias, before its scales (`UnscaledRows`), for the next
    kernel to apply them as it loads it: the sums in bfloat16 for bfloat16 rows (their range holds any sum
    of FP8 products, and the product rounds to bfloat16 anyway), else in float32 (float16's does not)."""
    raw_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    raw, x_scale = _raw_product(x, weight, raw_dtype)
    return UnscaledRows(raw, x_scale, scale.view(-1), x.dtype)


def fp8_linear_tensorwise(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_linear` of a per-channel weight: the unscaled product in float32 (`_raw_product`), then each
    row's and channel's scale and the bias in `_scale_rows_kernel`."""
    raw, x_scale = _raw_product(x, weight, torch.float32)
    m, n = raw.shape
    out = torch.empty(m, n, dtype=x.dtype, device=raw.device)
    _scale_rows_kernel[(triton.cdiv(m, 32), triton.cdiv(n, 128))](
        raw, x_scale, scale, bias if bias is not None else scale, out, m, n, HAS_BIAS=bias is not None,
        BLOCK_M=32, BLOCK_N=128, num_warps=4)
    return out


@triton.jit(do_not_specialize=["M"])   # an eager step's row count: no compile inside a served step
def _scale_rows_kernel(x_ptr, rs_ptr, cs_ptr, b_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    # out = x * row scale * channel scale (+ bias), x float32 [M, N], the scales [M, 1] and [N, 1]
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0)
    rs = tl.load(rs_ptr + rm, mask=rm < M, other=0.0)
    cs = tl.load(cs_ptr + rn, mask=rn < N, other=0.0)
    y = x * rs[:, None] * cs[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_linear_many(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product `fp8_linear` takes where neither Triton kernel does (at any row count): `_scaled_mm`
    with per-channel scales, else the dequantized layer."""
    if scaled_mm_fits(weight.shape, block):
        xq, x_scale = quantized_rows(x, x.shape[1])
        # the bias is added apart: not every _scaled_mm kernel takes one with rowwise scales
        out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype,
                               use_fast_accum=True)
        return out if bias is None else out.add_(bias)
    if isinstance(x, Fp8Rows):
        raise ValueError(f"the dequantized product of a {tuple(weight.shape)} weight with block {block} takes "
                         "unquantized rows (input_group is None)")
    return fp8_linear_torch(x, weight, scale, block, bias)
