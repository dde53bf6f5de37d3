"""Single-token products that stream their weights through a ring of shared-memory stages filled by the
Hopper tensor memory accelerator (TMA).

`gemv._gemv_kernel` keeps a weight tile in registers: each program asks for its next tile only once it
has summed the one before, so the bytes in flight per SM rise and fall with the programs' phases, and a
30-100 MB product streams at 3.0-3.8 TB/s on an H200. Here one program per SM owns a contiguous run of
row blocks and walks its tiles (BLOCK_N rows x BLOCK_K columns, 256 or 64, with SiLU-and-mul the matching
`up` rows too)
through STAGES shared-memory buffers: a tile's buffer is refilled with the tile STAGES further on as soon
as every warp has read it, so STAGES tiles are always on their way. The first STAGES copies are issued
before the programmatic-dependent-launch wait (`pdl.py`), while the kernel before still runs.

Same operation and rounding as `gemv.fused_linear` (RMSNorm (+ residual) before, SiLU-and-mul after,
optional bias); `gemv.fused_linear` calls `tma_linear` for a tile ("tma", BLOCK_N, STAGES, warps[,
programs per SM]). Gluon, which the interpreter does not run: the tests check the results on the GPU and
the sm90 code (copies before the wait) on the CPU.
"""
from __future__ import annotations

import torch
import triton

from tokenmill.layers.kernels.gemv_smem import SMEM_BYTES

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from tokenmill.layers.kernels.gemv_smem import _enter, _input_chunk
    AVAILABLE = True
except ImportError:       # a Triton without Gluon's Hopper module: fused_linear keeps its other tiles
    AVAILABLE = False



def smem_bytes(n: int, k: int, silu: bool, tile: tuple) -> int:
    """Shared memory one program of `tile` needs: the stages and their barriers."""
    _, block_n, stages, *rest = tile
    return stages * ((2 if silu else 1) * block_n * _block_k(tile) * 2 + 8)


def _block_k(tile: tuple) -> int:
    # columns per copy, the tile's sixth element: 256 (the most one TMA box dimension holds, unswizzled) or
    # 64 (one 128-byte line a row, swizzled)
    return tile[5] if len(tile) > 5 else 256


def check_tile(n: int, k: int, silu: bool, dtype: torch.dtype, tile: tuple,
               weight: torch.Tensor | None = None) -> str | None:
    """Why `tile` = ("tma", BLOCK_N, STAGES, warps[, programs per SM[, BLOCK_K]]) cannot run this product (of
    `weight`, if given), or None."""
    _, block_n, stages, num_warps, *rest = tile
    if not AVAILABLE:
        return "this Triton has no Gluon Hopper module"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} is not 16-bit"
    if weight is not None and (weight.data_ptr() % 16 or weight.stride(0) * weight.element_size() % 16):
        return "a TMA copy needs the weight's start and row stride on 16-byte boundaries"
    block_k = _block_k(tile)
    if block_k not in (64, 256):
        return f"BLOCK_K {block_k} must be 64 or 256"
    if k % block_k:
        return f"K {k} is not a multiple of {block_k}"
    rows_per_pass = num_warps * 256 // block_k
    if block_n & (block_n - 1) or block_n % rows_per_pass or block_n > 256:
        return (f"BLOCK_N {block_n} must be a power of two of at most 256 and a multiple of {rows_per_pass} "
                f"(num_warps {num_warps} x {256 // block_k} rows)")
    if stages < 1 or (rest and rest[0] < 1):
        return f"STAGES {stages} and programs per SM {rest} must be at least 1"
    need = smem_bytes(n, k, silu, tile)
    if need * (rest[0] if rest else 1) > SMEM_BYTES:
        return f"{stages} stages of {block_n} x {block_k} (K {k}) need {need} bytes of shared memory, over {SMEM_BYTES}"
    return None


if AVAILABLE:
    @gluon.jit
    def _issue(w_desc, ring, ring_u, bars, t, first, n_tiles, n_out, s,
               NUM_KB: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SILU: gl.constexpr):
        # copy tile t of this program (row block first + t // NUM_KB, column block t % NUM_KB) into stage s
        pred = t < n_tiles
        row = (first + t // NUM_KB) * BLOCK_N
        col = (t % NUM_KB) * BLOCK_K
        bar = bars.index(s)
        mbarrier.expect(bar, (2 if SILU else 1) * BLOCK_N * BLOCK_K * 2, pred=pred)
        tma.async_copy_global_to_shared(w_desc, [row, col], bar, ring.index(s), pred=pred)
        if SILU:    # [gate | up] stacked by rows: output row n needs weight rows n and n_out + n
            tma.async_copy_global_to_shared(w_desc, [n_out + row, col], bar, ring_u.index(s), pred=pred)

    @gluon.jit
    def _tma_gemv_kernel(w_desc, x_ptr, res_ptr, nw_ptr, b_ptr, out_ptr, res_out_ptr, eps, n_out,
                         K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                         NORM: gl.constexpr, RESIDUAL: gl.constexpr, HAS_BIAS: gl.constexpr,
                         SILU: gl.constexpr, PDL: gl.constexpr, NUM_WARPS: gl.constexpr):
        # 8 columns a thread: a warp reads 256 columns of a tile's rows at once (1 row, or 4 of 64 columns)
        NUM_KB: gl.constexpr = K // BLOCK_K
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8],
                                                threads_per_warp=[256 // BLOCK_K, BLOCK_K // 8],
                                                warps_per_cta=[NUM_WARPS, 1], order=[1, 0])
        cols: gl.constexpr = gl.SliceLayout(0, layout)
        pid = gl.program_id(0)
        num_programs = gl.num_programs(0)
        num_blocks = gl.cdiv(n_out, BLOCK_N)
        first = pid * num_blocks // num_programs       # this program's row blocks: first .. last - 1
        last = (pid + 1) * num_blocks // num_programs
        n_tiles = (last - first) * NUM_KB

        ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        ring_u = ring
        if SILU:
            ring_u = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        # weights never change: the first STAGES tiles are requested before the wait
        for s in gl.static_range(STAGES):
            _issue(w_desc, ring, ring_u, bars, s, first, n_tiles, n_out, s, NUM_KB, BLOCK_N, BLOCK_K, SILU)
        _enter(PDL)

        # the norm's scale: one pass over the input (loads only, all in flight at once)
        c = gl.arange(0, BLOCK_K, layout=cols)
        rstd = 1.0
        if NORM:
            sq = gl.zeros([BLOCK_K], gl.float32, cols)
            first_program = (c * 0 + pid) == 0     # a mask, not a branch: the loads stay free to overlap
            for i in gl.static_range(NUM_KB):
                h = _input_chunk(x_ptr, res_ptr, nw_ptr, 1.0, i * BLOCK_K + c, False, RESIDUAL)
                sq += h * h
                if RESIDUAL:
                    gl.store(res_out_ptr + i * BLOCK_K + c, h.to(res_out_ptr.dtype.element_ty), mask=first_program)
            rstd = gl.rsqrt(gl.sum(sq, 0) / K + eps)

        r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
        acc_u = acc
        for t in range(0, n_tiles):
            kb = t % NUM_KB
            # the input's columns for this tile (cached on chip after the norm's pass), asked for before
            # the wait so that their latency hides behind it
            xk = _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, kb * BLOCK_K + c, NORM, RESIDUAL)[None, :]
            stage = t % STAGES
            mbarrier.wait(bars.index(stage), (t // STAGES) & 1)
            w = ring.index(stage).load(layout)
            u = w
            if SILU:
                u = ring_u.index(stage).load(layout)
            gl.thread_barrier()    # every warp has read this stage: refill it with the tile STAGES on
            _issue(w_desc, ring, ring_u, bars, t + STAGES, first, n_tiles, n_out, stage, NUM_KB, BLOCK_N, BLOCK_K, SILU)
            acc += w.to(gl.float32) * xk
            if SILU:
                acc_u += u.to(gl.float32) * xk
            if kb == NUM_KB - 1:
                rows = (first + t // NUM_KB) * BLOCK_N + r
                row_mask = rows < n_out
                y = gl.sum(acc, 1)
                if HAS_BIAS:
                    y += gl.load(b_ptr + rows, mask=row_mask, other=0.0).to(gl.float32)
                if SILU:
                    g = y.to(out_ptr.dtype.element_ty).to(gl.float32)
                    up = gl.sum(acc_u, 1).to(out_ptr.dtype.element_ty).to(gl.float32)
                    act = (g / (1.0 + gl.exp(-g))).to(out_ptr.dtype.element_ty).to(gl.float32)
                    y = act * up
                gl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)
                acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
                acc_u = acc
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))


def _descriptor(weight: torch.Tensor, block_n: int, block_k: int):
    # kept on the weight itself (building one is host work a step should not redo), so it goes with it
    kept = weight.__dict__.setdefault("_tma_descriptors", {})
    key = (weight.data_ptr(), tuple(weight.shape), weight.stride(0), block_n, block_k)
    if key not in kept:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0 if block_k == 256 else 128, element_bitwidth=16, rank=2)
        kept[key] = TensorDescriptor.from_tensor(weight, [block_n, block_k], layout)
    return kept[key]


def tma_linear(x: torch.Tensor, weight: torch.Tensor, bias, norm_weight, eps: float, residual, silu: bool,
               out: torch.Tensor, res_out: torch.Tensor | None, tile: tuple, pdl_mode: int,
               num_sms: int) -> None:
    """One row of `gemv.fused_linear` (x [K], out [N or N / 2]) with `tile`, which `check_tile` passed;
    gemv.fused_linear checks the arguments and allocates the outputs."""
    _, block_n, stages, num_warps, *rest = tile
    n, k = weight.shape
    n_out = n // 2 if silu else n
    grid = (min(triton.cdiv(n_out, block_n), num_sms * (rest[0] if rest else 1)),)
    _tma_gemv_kernel[grid](
        _descriptor(weight, block_n, _block_k(tile)), x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, bias if bias is not None else x, out,
        res_out if res_out is not None else out, eps, n_out,
        K=k, BLOCK_N=block_n, BLOCK_K=_block_k(tile), STAGES=stages, NORM=norm_weight is not None, RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, SILU=silu, PDL=pdl_mode, NUM_WARPS=num_warps,
        num_warps=num_warps, launch_pdl=pdl_mode > 0)
