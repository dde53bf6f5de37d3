"""The end of a batch-1 decode step on the GPU machine: the final RMSNorm, the vocabulary head and the
greedy argmax, as the engine runs them now against single-token alternatives.

Each variant runs after a `down_proj` product (as in a step, so it meets a real predecessor), all of it
captured in one CUDA graph and repeated `--reps` times in that graph (the 0.8 GB head leaves nothing in
L2 for the next repeat). Variants are timed in turns; the table gives the median us per repeat and
each variant's difference from the first. Checks each variant's token against torch's argmax of the
float32 reference logits. Writes $OUT/head_bench.json.

  cublas   rms_norm kernel, F.linear (cuBLAS), argmax in torch (the engine's path when this was written)
  engine   rms_norm kernel, F.linear (cuBLAS), argmax.greedy (the engine's path since the argmax kernel)
  mv       the same with torch.mv(head, x) (cuBLAS's matrix-vector path) for the product
  mm_t     the same with (head @ x^T)^T (cuBLAS picks for N = 1 instead of M = 1)
  gemv:T   fused_linear with the norm folded in, register tile T (block_n x block_k x warps x programs
           per SM), argmax in torch

Each variant's kernels (names, from one profiled call) are listed with its row: whether cuBLAS adds a
memset before its product, for example.

Usage: python lab/head_bench.py [--models qwen3-4b,nanbeige4.1-3b] [--tiles 4x1024x4x8,...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

VOCAB = {"qwen3-4b": (151936, 2560, 9728), "nanbeige4.1-3b": (166144, 2560, 10496)}


def main() -> None:
    from gemv_bench import write_rows        # lab/, the script's own folder
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "device"))
    from profile_decode import replay_ms
    from tokenmill.layers.kernel_config import RegisterTile
    from tokenmill.layers.kernels import argmax, fused_ops, gemv

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default="qwen3-4b")
    ap.add_argument("--tiles", default="4x1024x4x8,8x512x4x8,8x1024x8x8,4x512x4x12,2x1024x4x12,16x256x4x8")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    bf16, rows = torch.bfloat16, []
    for model in args.models.split(","):
        vocab, hidden, inter = VOCAB[model]
        gen = torch.Generator(device="cuda").manual_seed(0)
        head = torch.randn(vocab, hidden, device="cuda", dtype=bf16, generator=gen) / 50
        down = torch.randn(hidden, inter, device="cuda", dtype=bf16, generator=gen) / 50
        act = torch.randn(1, inter, device="cuda", dtype=bf16, generator=gen)
        residual = torch.randn(1, hidden, device="cuda", dtype=bf16, generator=gen)
        nw = 1 + torch.randn(hidden, device="cuda", dtype=bf16, generator=gen) / 10
        h0, _ = gemv.fused_linear(act, down)
        ref_logits = gemv.fused_linear_torch(h0.float(), head.float(), norm_weight=nw.float(), eps=1e-6,
                                             residual=residual.float())[0]
        ref_token = int(ref_logits.argmax(-1))

        def cublas():
            h, _ = gemv.fused_linear(act, down)
            x, _ = fused_ops.rms_norm(h, nw, 1e-6, residual)
            return F.linear(x, head).argmax(-1)

        def fused(tile):
            def fn():
                h, _ = gemv.fused_linear(act, down)
                y, _ = gemv.fused_linear(h, head, norm_weight=nw, eps=1e-6, residual=residual,
                                         tile=RegisterTile(*tile))
                return y.argmax(-1)
            return fn

        def product(kind):
            def fn():
                h, _ = gemv.fused_linear(act, down)
                x, _ = fused_ops.rms_norm(h, nw, 1e-6, residual)
                if kind == "mv":
                    logits = torch.mv(head, x[0])[None]
                elif kind == "mm_t":
                    logits = torch.matmul(head, x.t()).t()
                else:
                    logits = F.linear(x, head)
                return argmax.greedy(logits.contiguous())
            return fn

        variants = {"cublas": cublas, "engine": product("linear"), "mv": product("mv"), "mm_t": product("mm_t")}
        for t in tiles:
            variants[f"gemv:{'x'.join(map(str, t))}"] = fused(t)
        graphs, checks = {}, {}
        for name, fn in variants.items():
            try:
                token = int(fn().reshape(-1)[0])
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(args.reps):
                        fn()
                graphs[name] = g
                checks[name] = token
            except Exception as e:   # a tile that does not compile: the others still run
                print(json.dumps({"model": model, "variant": name, "skipped": repr(e)[-400:]}), flush=True)
        kernels = {}
        for name in graphs:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                variants[name]()
                torch.cuda.synchronize()
            kernels[name] = [e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        times = {name: [] for name in graphs}
        for _ in range(5):                   # turns: every variant once per turn
            for name, g in graphs.items():
                times[name].append(replay_ms(g, 10) * 1e3)
        base = sorted(times["cublas"])[2] / args.reps
        for name, t in times.items():
            us = sorted(t)[len(t) // 2] / args.reps
            row = dict(model=model, variant=name, us=us, diff_us=us - base, token_ok=checks[name] == ref_token,
                       all_us=[x / args.reps for x in t], kernels=kernels[name])
            rows.append(row)
            print(json.dumps(row), flush=True)
        head = graphs = None     # frees them before the next model (the closures name head)
        torch.cuda.empty_cache()
    write_rows(args.out, "head_bench", rows,
               ["model", "variant (down, then norm + head + argmax)", "us", "vs cublas", "token ok"],
               lambda r: [r["model"], r["variant"], f"{r['us']:.1f}", f"{r['diff_us']:+.1f}", str(r["token_ok"])])


if __name__ == "__main__":
    main()
