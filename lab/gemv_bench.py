"""Single-token products on the GPU: the fused GEMV of `tokenmill.layers.kernels.gemv` against cuBLAS,
for each weight-reading product of a decoder layer, at the sizes of the presets.

Each variant runs as a CUDA graph over one weight copy per layer (so weights come from HBM, not L2), the
way a batch-1 decode step meets them: `qkv` = RMSNorm(+residual) then the product, `o`, `gate_up` =
RMSNorm(+residual), the product and SiLU-and-mul, `down`. The cuBLAS variant uses our norm and
activation kernels around `F.linear`; the GEMV variant folds them in. Every register tile (`RegisterTile`:
block_n x block_k x warps, at each programs-per-SM count) is timed; the fastest per shape goes to
gemv_configs.json as [N, K, gated, [block_n, block_k, num_warps, programs_per_sm]]. Then one graph of
whole layers (all four products, per layer) compares the two paths.

Usage: python lab/gemv_bench.py --out DIR [--models qwen3-4b,nanbeige4.1-3b]
       [--tiles 4x512x4,4x1024x4] [--per-sm 8] [--no-layers]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F

from tokenmill.layers.kernel_config import RegisterTile
from tokenmill.layers.kernels import fused_ops, gemv, pdl

SHAPES = {  # hidden, q width, kv width, intermediate, layers
    "qwen3-4b": (2560, 4096, 1024, 9728, 36),
    "nanbeige4.1-3b": (2560, 2560, 512, 10496, 32),
}
TILES = [(2, 1024, 4), (4, 512, 4), (4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4)]
PER_SM = [4, 8, 12, 16]


def graph_us(fn, reps: int = 20) -> float:
    """Device microseconds of one call of fn, captured in a CUDA graph (median of reps replays)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    del graph
    return sorted(times)[reps // 2]


def print_table(headers: list[str], lines) -> None:
    """A markdown table: `headers`, then one row of cells (strings) for each item of `lines`."""
    print("\n| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for cells in lines:
        print("| " + " | ".join(cells) + " |")


def write_rows(out: str, name: str, rows: list[dict], headers: list[str], cells) -> None:
    """`rows` to OUT/<name>.json, then printed as a markdown table of `cells(row)` under `headers`."""
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(rows, f, indent=1)
    print_table(headers, (cells(r) for r in rows))


def products(model: str):
    hidden, q, kv, inter, layers = SHAPES[model]
    # name, (N, K), norm+residual before, silu after
    return layers, [("qkv", (q + 2 * kv, hidden), True, False), ("o", (hidden, q), False, False),
                    ("gate_up", (2 * inter, hidden), True, True), ("down", (hidden, inter), False, False)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-4b,nanbeige4.1-3b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiles", default=",".join("x".join(map(str, t)) for t in TILES),
                    help="block_n x block_k x num_warps, comma-separated")
    ap.add_argument("--per-sm", default=",".join(map(str, PER_SM)))
    ap.add_argument("--no-layers", action="store_true", help="skip the whole-layer comparison")
    args = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    per_sms = [int(v) for v in args.per_sm.split(",")]
    os.makedirs(args.out, exist_ok=True)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"programmatic dependent launch: {pdl.enabled(dev)}", flush=True)
    configs, rows, layer_rows = [], [], []
    for model in args.models.split(","):
        layers, prods = products(model)
        weights = {}
        for name, (n, k), norm, silu in prods:
            ws = [torch.randn(n, k, device=dev, dtype=bf16, generator=gen) / k ** 0.5 for _ in range(layers)]
            weights[name] = ws
            x = torch.randn(1, k, device=dev, dtype=bf16, generator=gen)
            res = torch.randn(1, k, device=dev, dtype=bf16, generator=gen)
            nw = torch.ones(k, device=dev, dtype=bf16)
            mb = n * k * 2 / 1e6

            def cublas():
                for w in ws:
                    h = fused_ops.rms_norm(x, nw, 1e-6, res)[0] if norm else x
                    y = F.linear(h, w)
                    if silu:
                        fused_ops.act_and_mul(y)

            base = graph_us(cublas) / layers
            timed = {}
            for (bn, bk, warps), per_sm in itertools.product(tiles, per_sms):
                cfg = (bn, bk, warps, per_sm)

                def fused():
                    for w in ws:
                        gemv.fused_linear(x, w, norm_weight=nw if norm else None, eps=1e-6,
                                          residual=res if norm else None, act="silu" if silu else None,
                                          tile=RegisterTile(*cfg))
                timed[cfg] = graph_us(fused) / layers
            cfg = min(timed, key=timed.get)
            us = timed[cfg]
            configs.append([n, k, silu, list(cfg)])
            row = {"model": model, "product": name, "N": n, "K": k, "MB": round(mb, 1),
                   "cublas_us": round(base, 2), "cublas_TBs": round(mb / base, 2),   # MB / us = TB/s
                   "gemv_us": round(us, 2), "gemv_TBs": round(mb / us, 2), "config": cfg,
                   "all_us": {",".join(map(str, c)): round(t, 2) for c, t in timed.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)

        if args.no_layers:
            weights = None     # frees the copies
            continue
        # whole layers: every product of every layer in one graph, each path with its best
        hidden = SHAPES[model][0]
        x = torch.randn(1, hidden, device=dev, dtype=bf16, generator=gen)
        res = torch.randn(1, hidden, device=dev, dtype=bf16, generator=gen)
        nw = torch.ones(hidden, device=dev, dtype=bf16)
        q = SHAPES[model][1]
        table = {(n, k, s): tuple(c) for n, k, s, c in configs}

        def layer_cublas():
            h, r = x, res
            for i in range(layers):
                a, r = fused_ops.rms_norm(h, nw, 1e-6, r)
                o = F.linear(F.linear(a, weights["qkv"][i])[:, :q], weights["o"][i])
                a, r = fused_ops.rms_norm(o, nw, 1e-6, r)
                h = F.linear(fused_ops.act_and_mul(F.linear(a, weights["gate_up"][i])), weights["down"][i])

        def layer_gemv():
            h, r = x, res
            for i in range(layers):
                def lin(inp, name, **kw):
                    w = weights[name][i]
                    return gemv.fused_linear(inp, w, tile=RegisterTile(*table[(*w.shape, "act" in kw)]), **kw)
                a, r = lin(h, "qkv", norm_weight=nw, eps=1e-6, residual=r)
                o, _ = lin(a[:, :q].contiguous(), "o")
                a, r = lin(o, "gate_up", norm_weight=nw, eps=1e-6, residual=r, act="silu")
                h, _ = lin(a, "down")
        total_mb = sum(w.numel() * 2 for ws in weights.values() for w in ws) / 1e6
        for name, fn in (("cublas", layer_cublas), ("gemv", layer_gemv)):
            us = graph_us(fn, reps=10)
            layer_rows.append({"model": model, "path": name, "ms": round(us / 1e3, 3),
                               "TBs": round(total_mb / us, 2)})
            print(json.dumps(layer_rows[-1]), flush=True)
        weights = None
        torch.cuda.empty_cache()

    with open(os.path.join(args.out, "gemv_configs.json"), "w") as f:
        json.dump(configs, f)
    with open(os.path.join(args.out, "gemv_bench.json"), "w") as f:
        json.dump({"products": rows, "layers": layer_rows, "pdl": pdl.enabled(dev)}, f, indent=1)
    print_table(["model", "product", "N x K", "MB", "cuBLAS us (TB/s)", "GEMV us (TB/s)", "GEMV config"],
                ([r["model"], r["product"], f"{r['N']} x {r['K']}", str(r["MB"]),
                  f"{r['cublas_us']} ({r['cublas_TBs']})", f"{r['gemv_us']} ({r['gemv_TBs']})",
                  str(tuple(r["config"]))] for r in rows))
    print_table(["model", "path", "all layers' products, ms", "TB/s"],
                ([r["model"], r["path"], str(r["ms"]), str(r["TBs"])] for r in layer_rows))


if __name__ == "__main__":
    main()
