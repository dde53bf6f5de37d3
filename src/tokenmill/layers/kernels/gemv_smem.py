"""Single-token products that copy their whole weight block to shared memory before the
programmatic-dependent-launch wait (`pdl.py`).

`gemv._gemv_kernel` holds one weight tile in registers before its wait, so a product streams its weights
only once the kernel before it has finished. Here each program owns one block of output rows and issues
`cp.async` copies of all its weight rows (BLOCK_N x K, and the matching `up` rows with an activation) into shared
memory first. A product launched during a short kernel (o_proj during attention) then has its weights
on chip, or on their way, when its input is ready. Shared memory bounds the block: BLOCK_N x K x 2 bytes
(twice that with an activation) must fit one program, and programs beyond what the SMs hold at once start as
earlier ones finish.

Same operation and rounding as `gemv.fused_linear` (RMSNorm (+ residual) before, the gated activation after,
optional bias); `gemv.fused_linear` calls `smem_linear` for an `SmemTile`.
Written in Gluon, Triton's dialect with explicit layouts and shared memory, which the interpreter does
not run: the tests check it on the GPU, and its sm90 code (copies before the wait) on the CPU.
"""
from __future__ import annotations

import torch
import triton

from tokenmill.layers.kernel_config import SmemTile

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    AVAILABLE = True
except ImportError:       # a Triton without Gluon: fused_linear keeps its plain tiles
    AVAILABLE = False

SMEM_BYTES = 227 * 1024   # shared memory one program may hold on sm90


def check_tile(n: int, k: int, gated: bool, dtype: torch.dtype, tile: SmemTile) -> str | None:
    """Why `tile` cannot run this product (a gated activation after it when `gated`), or None if it can."""
    block_n, block_k, num_warps = tile.block_n, tile.block_k, tile.num_warps
    if not AVAILABLE:
        return "this Triton has no Gluon"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} is not 16-bit"
    if block_k < 256 or block_k & (block_k - 1) or k % block_k:
        return f"BLOCK_K {block_k} must be a power of two of at least 256 that divides K {k}"
    if block_n % num_warps or block_n & (block_n - 1):
        return f"BLOCK_N {block_n} must be a power of two and a multiple of num_warps {num_warps}"
    need = (2 if gated else 1) * block_n * k * 2
    if need > SMEM_BYTES:
        return f"BLOCK_N {block_n} x K {k} needs {need} bytes of shared memory, over {SMEM_BYTES}"
    return None


if AVAILABLE:
    @gluon.jit
    def _enter(PDL: gl.constexpr):
        # pdl.enter in Gluon: lets the next kernel launch, then waits
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)

    @gluon.jit
    def _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, kk, NORM: gl.constexpr, RESIDUAL: gl.constexpr):
        # columns kk of the product's input in float32, rounded as gemv_whole.input_chunk rounds them
        h = gl.load(x_ptr + kk)
        if RESIDUAL:
            h = (h.to(gl.float32) + gl.load(res_ptr + kk).to(gl.float32)).to(h.dtype)
        if NORM:
            h = (h.to(gl.float32) * rstd).to(h.dtype)
            h = (h.to(gl.float32) * gl.load(nw_ptr + kk).to(gl.float32)).to(h.dtype)
        return h.to(gl.float32)

    @gluon.jit
    def _gate_act(g, ACT: gl.constexpr):
        # fused_ops.gate_act in Gluon: SiLU (ACT 1) or GELU's tanh approximation as g sigmoid(2u) (2)
        if ACT == 2:
            return g / (1.0 + gl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))
        else:
            return g / (1.0 + gl.exp(-g))

    @gluon.jit
    def _smem_gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, eps, n_out, w_stride,
                          K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                          NORM: gl.constexpr, RESIDUAL: gl.constexpr, HAS_BIAS: gl.constexpr,
                          ACT: gl.constexpr, PDL: gl.constexpr, NUM_WARPS: gl.constexpr):
        # One program: output rows pid * BLOCK_N ..., its weight rows in shared memory as K // BLOCK_K
        # chunks. A warp per row, 16-byte copies, 256 columns a pass, so no element is copied twice.
        NUM_CHUNKS: gl.constexpr = K // BLOCK_K
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32],
                                                warps_per_cta=[NUM_WARPS, 1], order=[1, 0])
        cols: gl.constexpr = gl.SliceLayout(0, layout)
        smem_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        pid = gl.program_id(0)
        r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        c = gl.arange(0, BLOCK_K, layout=cols)
        out_rows = pid * BLOCK_N + r
        rows = gl.minimum(out_rows, n_out - 1).to(gl.int64)    # a ragged last block re-reads the last row
        w_src = w_ptr + rows[:, None] * w_stride + c[None, :]
        w_s = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [NUM_CHUNKS, BLOCK_N, BLOCK_K], smem_layout)
        for i in gl.static_range(NUM_CHUNKS):
            async_copy.async_copy_global_to_shared(w_s.index(i), w_src + i * BLOCK_K)
        if ACT != 0:    # [gate | up] stacked by rows: output row n needs weight rows n and n_out + n
            u_s = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [NUM_CHUNKS, BLOCK_N, BLOCK_K], smem_layout)
            u_src = w_src + n_out.to(gl.int64) * w_stride
            for i in gl.static_range(NUM_CHUNKS):
                async_copy.async_copy_global_to_shared(u_s.index(i), u_src + i * BLOCK_K)
        async_copy.commit_group()
        _enter(PDL)

        rstd = 1.0
        if NORM:
            sq = gl.zeros([BLOCK_K], gl.float32, cols)
            for i in gl.static_range(NUM_CHUNKS):
                h = _input_chunk(x_ptr, res_ptr, nw_ptr, 1.0, i * BLOCK_K + c, False, RESIDUAL)
                sq += h * h
                if RESIDUAL:
                    if pid == 0:
                        gl.store(res_out_ptr + i * BLOCK_K + c, h.to(res_out_ptr.dtype.element_ty))
            rstd = gl.rsqrt(gl.sum(sq, 0) / K + eps)

        async_copy.wait_group(0)
        gl.thread_barrier()
        acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
        acc_u = acc
        for i in gl.static_range(NUM_CHUNKS):
            xk = _input_chunk(x_ptr, res_ptr, nw_ptr, rstd, i * BLOCK_K + c, NORM, RESIDUAL)[None, :]
            acc += w_s.index(i).load(layout).to(gl.float32) * xk
            if ACT != 0:
                acc_u += u_s.index(i).load(layout).to(gl.float32) * xk
        y = gl.sum(acc, 1)
        if HAS_BIAS:
            y += gl.load(b_ptr + rows).to(gl.float32)
        if ACT != 0:
            g = y.to(out_ptr.dtype.element_ty).to(gl.float32)
            up = gl.sum(acc_u, 1).to(out_ptr.dtype.element_ty).to(gl.float32)
            y = _gate_act(g, ACT).to(out_ptr.dtype.element_ty).to(gl.float32) * up
        gl.store(out_ptr + out_rows, y.to(out_ptr.dtype.element_ty), mask=out_rows < n_out)


def smem_linear(x: torch.Tensor, weight: torch.Tensor, bias, norm_weight, eps: float, residual, act: int,
                out: torch.Tensor, res_out: torch.Tensor | None, tile: SmemTile, pdl_on: bool) -> None:
    """One row of `gemv.fused_linear` (x [K], out [N or N / 2]) with `tile`, which `check_tile` passed; `act`: the
    activation's number (`activation.ACTIVATIONS`; 0: none). gemv.fused_linear checks the arguments and allocates
    the outputs."""
    block_n, block_k, num_warps = tile.block_n, tile.block_k, tile.num_warps
    n, k = weight.shape
    n_out = n // 2 if act else n
    _smem_gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight,
        weight, bias if bias is not None else weight, out, res_out if res_out is not None else out,
        eps, n_out, weight.stride(0),
        K=k, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None, RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, ACT=act, PDL=pdl_on, NUM_WARPS=num_warps,
        num_warps=num_warps, launch_pdl=pdl_on)
