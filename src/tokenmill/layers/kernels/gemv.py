"""Triton GEMV for the few-row matrix products of small-batch decode: out = x @ W.T (+ bias).

At batch 1 to a few rows, a decode step is a stream of weight reads, and each linear layer is
memory-bound: the kernel's only job is to read W [N, K] once at full bandwidth. Each program owns
BLOCK_N output columns and walks K in BLOCK_K tiles, multiplying every loaded tile by all M rows of x
(so W is read once for the whole batch), with float32 accumulation. With `silu_mul` the weight is a
packed [gate | up] projection [2I, K] and the program computes both halves of its columns and writes
silu(gate) * up [M, I], which saves the activation kernel and a round trip of the intermediate.

Reference: `torch.nn.functional.linear` (and `silu_and_mul_torch` for `silu_mul`), rounded to x.dtype
once at the end: results agree with a float32 product to bf16 rounding, not bit for bit with cuBLAS.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# rows handled by one launch; larger batches go to cuBLAS, which then runs at full bandwidth itself
MAX_ROWS = 8


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, x_stride_m, w_stride_n, o_stride_m, up_offset,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    n_mask = n < N
    m_mask = m < M
    w_rows = w_ptr + n.to(tl.int64)[:, None] * w_stride_n
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_stride_m
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        if EVEN_K:
            w_mask = n_mask[:, None]
            x_mask = m_mask[:, None]
        else:
            w_mask = n_mask[:, None] & (k < K)[None, :]
            x_mask = m_mask[:, None] & (k < K)[None, :]
        x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if SILU_MUL:
            u = tl.load(w_rows + up_offset + k[None, :], mask=w_mask, other=0.0).to(tl.float32)
            acc_up += tl.sum(x[:, None, :] * u[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + m.to(tl.int64)[:, None] * o_stride_m + n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SILU_MUL:
        # the same two roundings as F.linear followed by silu_and_mul: gate and up in x.dtype first
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(dst, (act * up).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


def default_config(rows: int, n: int, k: int) -> dict:
    """Tile sizes per problem: narrow column blocks so that even N = 2560 spreads over hundreds of
    programs, and K tiles that keep each thread's loads 16 bytes wide."""
    block_n = 4 if rows <= 2 else 2
    return {"block_n": block_n, "block_k": 512 if rows <= 2 else 256, "num_warps": 4, "num_stages": 3}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
         config: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, unit last stride) times weight [N, K] (contiguous rows) -> [M, N], or
    [M, N / 2] = silu(x @ W[:N/2].T) * (x @ W[N/2:].T) with `silu_mul`."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    rows, k = x.shape
    n = weight.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"gemv: {rows} rows > MAX_ROWS={MAX_ROWS}; use a matrix product")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"gemv: x dtype {x.dtype} and weight dtype {weight.dtype} must be equal and one "
                        f"of {_DTYPES}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv: x and weight need a unit last stride, got {x.stride()} and {weight.stride()}")
    if silu_mul and (n % 2 or bias is not None):
        raise ValueError(f"gemv: silu_mul needs an even N (got {n}) and no bias")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"gemv: bias must be {x.dtype} [{n}], got {bias.dtype} {tuple(bias.shape)}")
    out_n = n // 2 if silu_mul else n
    out = torch.empty((rows, out_n), dtype=x.dtype, device=x.device)
    if rows == 0 or out_n == 0:
        return out
    cfg = {**default_config(rows, out_n, k), **(config or {})}
    block_k = min(cfg["block_k"], triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(out_n, cfg["block_n"]),)](
        x, weight, bias if bias is not None else x, out, rows, out_n, k,
        x.stride(0), weight.stride(0), out.stride(0), out_n * weight.stride(0),
        BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=cfg["block_n"], BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
