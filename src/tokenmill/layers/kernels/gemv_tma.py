"""Single-token products streamed by the Hopper tensor memory accelerator (TMA), the work split evenly
over one program per SM.

The register and shared-memory tiles of `gemv.py` / `gemv_smem.py` stream a layer's 20-100 MB products
at 3.0-3.8 TB/s on an H200, where the 778 MB head (cuBLAS, TMA-fed) reaches 4.3. A TMA ring of boxes of
BLOCK_N rows x 64 columns (128-byte swizzled) feeds one program per SM at more than the HBM's share of
an SM (docs/BENCHMARKS.md), but a product of 2,560 or 6,144 rows has too few row blocks of 128-256 rows
to give every SM the same number. So the tiles (row block, 64-column chunk) are numbered row block by
row block and each program takes an equal run of them ("stream-K"): a row block may be summed in pieces
by a few consecutive programs. A piece that is not the whole row block stores its row sums in float32;
the last piece to finish (a counter, left zeroed) adds the pieces in program order, so the result does
not depend on which finished first, and writes the output.

Each program streams its run through STAGES shared-memory buffers: the first STAGES copies are issued
before the programmatic-dependent-launch wait (`pdl.py`), and a buffer is refilled with the tile STAGES
further on as soon as every warp has read it. Same operation and rounding as `gemv.fused_linear`
(RMSNorm (+ residual) before, SiLU-and-mul after, optional bias), which calls `tma_linear` for a tile
("tma", BLOCK_N, STAGES, warps[, programs per SM]). Gluon, which the interpreter does not run: the tests
check the results on the GPU and the sm90 code (copies before the wait) on the CPU.
"""
from __future__ import annotations

import torch
import triton

from tokenmill.layers.kernels.counters import zeroed as zeroed_counters
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

BLOCK_K = 64              # columns per box: one 128-byte line a row, swizzled


def smem_bytes(silu: bool, tile: tuple) -> int:
    """Shared memory one program of `tile` needs: the stages and their barriers."""
    _, block_n, stages, *_ = tile
    return stages * ((2 if silu else 1) * block_n * BLOCK_K * 2 + 8)


def check_tile(n: int, k: int, silu: bool, dtype: torch.dtype, tile: tuple,
               weight: torch.Tensor | None = None) -> str | None:
    """Why `tile` = ("tma", BLOCK_N, STAGES, warps[, programs per SM]) cannot run this product (of
    `weight`, if given), or None."""
    _, block_n, stages, num_warps, *rest = tile
    if not AVAILABLE:
        return "this Triton has no Gluon Hopper module"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} is not 16-bit"
    if weight is not None and (weight.data_ptr() % 16 or weight.stride(0) * weight.element_size() % 16):
        return "a TMA copy needs the weight's start and row stride on 16-byte boundaries"
    if k % (32 * num_warps) or k % BLOCK_K:
        return f"K {k} is not a multiple of {max(BLOCK_K, 32 * num_warps)} (num_warps {num_warps})"
    if block_n & (block_n - 1) or block_n % (4 * num_warps) or block_n > 256:
        return (f"BLOCK_N {block_n} must be a power of two of at most 256 and a multiple of "
                f"{4 * num_warps} (4 rows a warp, num_warps {num_warps})")
    if stages < 1 or (rest and rest[0] < 1):
        return f"STAGES {stages} and programs per SM {rest} must be at least 1"
    need = smem_bytes(silu, tile) * (rest[0] if rest else 1)
    if need > SMEM_BYTES:
        return (f"{stages} stages of {block_n} x {BLOCK_K} (x{rest[0] if rest else 1} programs a SM) need "
                f"{need} bytes of shared memory, over {SMEM_BYTES}")
    return None


def _owner(t: int, tiles: int, programs: int) -> int:
    # the program whose run [p * tiles // programs, (p + 1) * tiles // programs) holds tile t
    return ((t + 1) * programs + tiles - 1) // tiles - 1


if AVAILABLE:
    @gluon.jit
    def _owner_of(t, tiles, programs):
        return ((t + 1) * programs + tiles - 1) // tiles - 1

    @gluon.jit
    def _issue(w_desc, ring, ring_u, bars, t, t_end, n_out, s,
               NUM_KB: gl.constexpr, BLOCK_N: gl.constexpr, SILU: gl.constexpr):
        # copy tile t (row block t // NUM_KB, column chunk t % NUM_KB) into stage s, if t is in the run
        pred = t < t_end
        row = (t // NUM_KB) * BLOCK_N
        col = (t % NUM_KB) * 64
        bar = bars.index(s)
        mbarrier.expect(bar, (2 if SILU else 1) * BLOCK_N * 64 * 2, pred=pred)
        tma.async_copy_global_to_shared(w_desc, [row, col], bar, ring.index(s), pred=pred)
        if SILU:    # [gate | up] stacked by rows: output row n needs weight rows n and n_out + n
            tma.async_copy_global_to_shared(w_desc, [n_out + row, col], bar, ring_u.index(s), pred=pred)

    @gluon.jit
    def _finish(y, y_u, rows, b_ptr, out_ptr, n_out, HAS_BIAS: gl.constexpr, SILU: gl.constexpr):
        # a row block's float32 sums -> its output rows, rounded as gemv._gemv_kernel rounds them
        row_mask = rows < n_out
        if HAS_BIAS:
            y += gl.load(b_ptr + rows, mask=row_mask, other=0.0).to(gl.float32)
        if SILU:
            g = y.to(out_ptr.dtype.element_ty).to(gl.float32)
            up = y_u.to(out_ptr.dtype.element_ty).to(gl.float32)
            act = (g / (1.0 + gl.exp(-g))).to(out_ptr.dtype.element_ty).to(gl.float32)
            y = act * up
        gl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)

    @gluon.jit
    def _tma_gemv_kernel(w_desc, x_ptr, res_ptr, nw_ptr, b_ptr, out_ptr, res_out_ptr, part_ptr, counter_ptr,
                         eps, n_out, K: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         MAX_PIECES: gl.constexpr, NORM: gl.constexpr, RESIDUAL: gl.constexpr,
                         HAS_BIAS: gl.constexpr, SILU: gl.constexpr, PDL: gl.constexpr,
                         NUM_WARPS: gl.constexpr):
        # 8 columns a thread, 8 threads a 64-column row, 4 rows a warp
        NUM_KB: gl.constexpr = K // 64
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                warps_per_cta=[NUM_WARPS, 1], order=[1, 0])
        cols: gl.constexpr = gl.SliceLayout(0, layout)
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        flat: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                              warps_per_cta=[NUM_WARPS], order=[0])
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        tiles = gl.cdiv(n_out, BLOCK_N) * NUM_KB
        t_start = pid * tiles // programs        # this program's run of tiles
        t_end = (pid + 1) * tiles // programs

        ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, 64], w_desc.layout)
        ring_u = ring
        if SILU:
            ring_u = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, 64], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        # weights never change: the first STAGES tiles are requested before the wait
        for s in gl.static_range(STAGES):
            _issue(w_desc, ring, ring_u, bars, t_start + s, t_end, n_out, s, NUM_KB, BLOCK_N, SILU)
        _enter(PDL)

        rstd = 1.0
        if NORM:    # every program sums the squares itself (loads only, all in flight at once)
            f = gl.arange(0, 32 * NUM_WARPS, layout=flat)
            first_program = (f * 0 + pid) == 0
            sq = gl.zeros([32 * NUM_WARPS], gl.float32, flat)
            for i in gl.static_range(K // (32 * NUM_WARPS)):
                kk = i * 32 * NUM_WARPS + f
                h = _input_chunk(x_ptr, res_ptr, nw_ptr, 1.0, kk, False, RESIDUAL)
                sq += h * h
                if RESIDUAL:
                    gl.store(res_out_ptr + kk, h.to(res_out_ptr.dtype.element_ty), mask=first_program)
            rstd = gl.rsqrt(gl.sum(sq, 0) / K + eps)

        c = gl.arange(0, 64, layout=cols)
        r = gl.arange(0, BLOCK_N, layout=row_layout)
        acc = gl.zeros([BLOCK_N], gl.float32, row_layout)
        acc_u = acc
        for i in range(0, t_end - t_start):
            t = t_start + i
            kb = t % NUM_KB
            # the input's columns for this tile, asked for before the wait so their latency hides behind it
            xk = _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, kb * 64 + c, NORM, RESIDUAL)[None, :]
            stage = i % STAGES
            mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
            w = ring.index(stage).load(layout)
            u = w
            if SILU:
                u = ring_u.index(stage).load(layout)
            gl.thread_barrier()    # every warp has read this stage: refill it with the tile STAGES on
            _issue(w_desc, ring, ring_u, bars, t + STAGES, t_end, n_out, stage, NUM_KB, BLOCK_N, SILU)
            acc += gl.sum(w.to(gl.float32) * xk, 1)
            if SILU:
                acc_u += gl.sum(u.to(gl.float32) * xk, 1)
            if (kb == NUM_KB - 1) | (t == t_end - 1):      # the end of this program's piece of a row block
                rb = t // NUM_KB
                rows = rb * BLOCK_N + r
                if (kb == NUM_KB - 1) & (rb * NUM_KB >= t_start):
                    _finish(acc, acc_u, rows, b_ptr, out_ptr, n_out, HAS_BIAS, SILU)
                else:
                    first = _owner_of(rb * NUM_KB, tiles, programs)
                    pieces = _owner_of(rb * NUM_KB + NUM_KB - 1, tiles, programs) - first + 1
                    part = part_ptr + ((rb * MAX_PIECES + pid - first) * 2) * BLOCK_N + r
                    gl.store(part, acc)
                    gl.store(part + BLOCK_N, acc_u)
                    # release this piece, and learn whether every other piece has released its own
                    done = gl.atomic_add(counter_ptr + rb, 1, sem="acq_rel", scope="gpu")
                    if done == pieces - 1:
                        y = gl.zeros([BLOCK_N], gl.float32, row_layout)
                        y_u = y
                        for j in range(0, pieces):         # in program order: the same sum every time
                            src = part_ptr + ((rb * MAX_PIECES + j) * 2) * BLOCK_N + r
                            y += gl.load(src, cache_modifier=".cg")
                            y_u += gl.load(src + BLOCK_N, cache_modifier=".cg")
                        _finish(y, y_u, rows, b_ptr, out_ptr, n_out, HAS_BIAS, SILU)
                        gl.store(counter_ptr + rb, 0)      # every piece has counted
                acc = gl.zeros([BLOCK_N], gl.float32, row_layout)
                acc_u = acc
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))


def _descriptor(weight: torch.Tensor, block_n: int):
    # kept on the weight itself (building one is host work a step should not redo), so it goes with it
    kept = weight.__dict__.setdefault("_tma_descriptors", {})
    key = (weight.data_ptr(), tuple(weight.shape), weight.stride(0), block_n)
    if key not in kept:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        kept[key] = TensorDescriptor.from_tensor(weight, [block_n, BLOCK_K], layout)
    return kept[key]


def max_pieces(blocks: int, num_kb: int, programs: int) -> int:
    """The most programs that share one row block when `programs` take equal runs of the tiles."""
    tiles = blocks * num_kb
    return max(_owner(rb * num_kb + num_kb - 1, tiles, programs) - _owner(rb * num_kb, tiles, programs) + 1
               for rb in range(blocks))


def tma_linear(x: torch.Tensor, weight: torch.Tensor, bias, norm_weight, eps: float, residual, silu: bool,
               out: torch.Tensor, res_out: torch.Tensor | None, tile: tuple, pdl_mode: int,
               num_sms: int) -> None:
    """One row of `gemv.fused_linear` (x [K], out [N or N / 2]) with `tile`, which `check_tile` passed;
    gemv.fused_linear checks the arguments and allocates the outputs."""
    _, block_n, stages, num_warps, *rest = tile
    n, k = weight.shape
    n_out = n // 2 if silu else n
    blocks, num_kb = triton.cdiv(n_out, block_n), k // BLOCK_K
    programs = min(blocks * num_kb, num_sms * (rest[0] if rest else 1))
    pieces = max_pieces(blocks, num_kb, programs)
    parts = torch.empty(blocks * pieces * 2 * block_n, dtype=torch.float32, device=x.device)
    _tma_gemv_kernel[(programs,)](
        _descriptor(weight, block_n), x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, bias if bias is not None else x, out,
        res_out if res_out is not None else out, parts, zeroed_counters(x.device, blocks), eps, n_out,
        K=k, BLOCK_N=block_n, STAGES=stages, MAX_PIECES=pieces, NORM=norm_weight is not None,
        RESIDUAL=residual is not None, HAS_BIAS=bias is not None, SILU=silu, PDL=pdl_mode,
        NUM_WARPS=num_warps, num_warps=num_warps, launch_pdl=pdl_mode > 0)
