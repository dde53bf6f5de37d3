"""Experiment, on the GPU machine: a single-token product whose weights go to shared memory before its
programmatic-dependent-launch wait, timed where it would pay, as the o_proj after attention.

`gemv.fused_linear` can hold only its first weight tile in registers before the wait, so the o_proj
after attention starts streaming its 21 MB (qwen3-4b) only once attention ends. Here each program
copies its whole row block (8 rows x K, 64 KB at K=4096) into shared memory with cp.async before the
wait, three programs per SM: all of o_proj is in flight while attention runs. Written in Gluon
(Triton's explicit-layout dialect) because plain Triton allocates no shared memory by hand; it does
not run in the interpreter, so this script checks it against torch on the GPU before timing it.

Prints, per model and context: the product alone against torch and `fused_linear` (max abs error),
then us per layer of qkv + attention + o_proj, 36 layers in one CUDA graph (as
decode_attention_bench.py), with o_proj from `fused_linear` and from this kernel, and the attention
letting o_proj launch before its wait (programmatic-dependent-launch mode 2) or after it (1).

Usage: python scripts/device/gemv_smem.py [--contexts 160,1000] [--models qwen3-4b,nanbeige4.1-3b]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy


@gluon.jit
def _pdl_enter(PDL: gl.constexpr):
    # as pdl.enter(2): let the next kernel launch, then wait for the one before
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def _smem_gemv_kernel(x_ptr, w_ptr, out_ptr, n_out, K: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, NUM_WARPS: gl.constexpr, PDL: gl.constexpr):
    # one program: rows pid * BLOCK_N ... of y = W x, its whole [BLOCK_N, K] weight block in shared
    # memory (NUM_CHUNKS chunks of BLOCK_K columns), copied before the wait
    NUM_CHUNKS: gl.constexpr = K // BLOCK_K
    # a warp per row (16-byte copies, 256 columns a pass): no element is held twice if BLOCK_N is a
    # multiple of NUM_WARPS and BLOCK_K of 256
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32],
                                            warps_per_cta=[NUM_WARPS, 1], order=[1, 0])
    smem_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    smem = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [NUM_CHUNKS, BLOCK_N, BLOCK_K], smem_layout)
    pid = gl.program_id(0)
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    rows = gl.minimum(pid * BLOCK_N + r, n_out - 1)      # a ragged last block re-reads the last row
    src = w_ptr + rows.to(gl.int64)[:, None] * K + c[None, :]
    for i in gl.static_range(NUM_CHUNKS):
        async_copy.async_copy_global_to_shared(smem.index(i), src + i * BLOCK_K)
    async_copy.commit_group()
    _pdl_enter(PDL)
    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
    async_copy.wait_group(0)
    gl.thread_barrier()
    for i in gl.static_range(NUM_CHUNKS):
        xk = gl.load(x_ptr + i * BLOCK_K + c).to(gl.float32)
        acc += smem.index(i).load(layout).to(gl.float32) * xk[None, :]
    y = gl.sum(acc, axis=1)
    gl.store(out_ptr + pid * BLOCK_N + r, y.to(out_ptr.dtype.element_ty), mask=pid * BLOCK_N + r < n_out)


def smem_linear(x: torch.Tensor, w: torch.Tensor, block_n: int = 8, block_k: int = 512,
                num_warps: int = 4) -> torch.Tensor:
    """x [1, K] @ w[N, K].T -> [1, N], w contiguous, K a multiple of block_k."""
    n, k = w.shape
    if (x.shape != (1, k) or not (x.is_contiguous() and w.is_contiguous()) or k % block_k or block_k % 256
            or block_n % num_warps):
        raise ValueError(f"smem_linear: x {tuple(x.shape)}, w {tuple(w.shape)}, block_k {block_k}")
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _smem_gemv_kernel[(triton.cdiv(n, block_n),)](x, w, out, n, K=k, BLOCK_N=block_n, BLOCK_K=block_k,
                                                  NUM_WARPS=num_warps, PDL=True, num_warps=num_warps,
                                                  launch_pdl=True)
    return out


def capture(s, o_proj) -> torch.cuda.CUDAGraph:
    """decode_attention_bench's qkv + attention + o_proj chain over all layers, as one CUDA graph."""
    import decode_attention_bench as dab
    dab.step(s, 64, o_proj)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dab.step(s, 64, o_proj)
    return graph


def main() -> None:
    import decode_attention_bench as dab   # scripts/device/, the script's own folder
    from profile_decode import replay_ms
    from tokenmill.layers.kernels import gemv, pdl

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default="qwen3-4b,nanbeige4.1-3b")
    ap.add_argument("--contexts", default="160,1000")
    ap.add_argument("--tiles", default="8x512x4,4x512x4,8x1024x8", help="block_n x block_k x warps")
    args = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    rows = []
    for model in args.models.split(","):
        hidden, hq, _, _ = dab.SHAPES[model]
        gen = torch.Generator(device="cuda").manual_seed(1)
        w = torch.randn(hidden, hq * dab.HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen) / 64
        x = torch.randn(1, hq * dab.HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = (x.float() @ w.float().t())
        fits = [(bn, bk, nw) for bn, bk, nw in tiles if w.shape[1] % bk == 0]   # K in whole chunks
        errs = {f"{bn}x{bk}x{nw}": (smem_linear(x, w, bn, bk, nw).float() - ref).abs().max().item()
                for bn, bk, nw in fits}
        errs["fused_linear"] = (gemv.fused_linear(x, w)[0].float() - ref).abs().max().item()
        print(json.dumps({"model": model, "max_abs_err_vs_fp32": errs}), flush=True)
        for ctx in (int(c) for c in args.contexts.split(",")):
            s = dab.build(model, 1, ctx)
            variants = {"fused_linear": None, **{f"{bn}x{bk}x{nw}": (bn, bk, nw) for bn, bk, nw in fits}}
            # attention's launch mode: 2 lets o_proj launch (and copy) while qkv still runs, 1 only once
            # attention has passed its own wait, so o_proj's copies overlap attention alone
            graphs = {}
            for attn_mode in (2, 1):
                pdl.ATTENTION_MODE = attn_mode
                for name, tile in variants.items():
                    o_proj = (lambda a, w_o: gemv.fused_linear(a, w_o)[0]) if tile is None else (
                        lambda a, w_o, tile=tile: smem_linear(a, w_o, *tile))
                    graphs[f"{name}, attention pdl {attn_mode}"] = capture(s, o_proj)
            pdl.ATTENTION_MODE = None
            turns = {name: [] for name in graphs}
            for _ in range(5):                       # in turns, so drift hits every variant alike
                for name, graph in graphs.items():
                    turns[name].append(replay_ms(graph, 50) * 1000 / dab.LAYERS)
            res = {name: sorted(t)[len(t) // 2] for name, t in turns.items()}
            rows.append(dict(model=model, ctx=ctx, us_per_layer=res, turns=turns))
            print(json.dumps(rows[-1]), flush=True)
            del s, graphs
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "gemv_smem.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n| model | context | o_proj | us per layer |")
    print("|---|---|---|---|")
    for r in rows:
        for name, us in r["us_per_layer"].items():
            print(f"| {r['model']} | {r['ctx']} | {name} | {us:.2f} |")
    print("\n(us per layer: qkv product + one-kernel attention + o_proj, batch 1, 36 layers in one CUDA graph; "
          "medians of five turns)")


if __name__ == "__main__":
    main()
