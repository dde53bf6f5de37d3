"""The GEMV kernel against cuBLAS (F.linear) on the linear layers of Qwen3-4B, at 1 to 8 rows.

Run on the GPU machine:  PYTHONPATH=src python scripts/device/gemv_bench.py [--quick]

Each timing is one CUDA graph of one launch per weight copy, enough copies that the weights are read
from HBM and not from L2 (as in a decode step, where every layer has its own weights), replayed many
times; microseconds per launch are the median of 5 such measurements. The gate_up layer is timed as
cuBLAS + the silu_and_mul kernel against the fused `silu_mul` GEMV. Every config is checked against a
float32 product first. Prints a table of the best config per (layer, rows) last and writes
$OUT/gemv_bench.json when OUT is set.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

from tokenmill.layers.kernels import fused_ops, gemv  # noqa: E402

LAYERS = {   # name: (N, K, silu_mul)
    "qkv": (6144, 2560, False), "o": (2560, 4096, False), "gate_up": (19456, 2560, True),
    "down": (2560, 9728, False), "lm_head": (151936, 2560, False), "down_nanbeige": (2560, 10496, False),
}


def configs(rows: int, quick: bool):
    if quick:
        return [gemv.default_config(rows, 0, 0)]
    if rows == 1:
        grid = itertools.product([2, 4, 8, 16], [512, 1024], [(4, 3), (4, 4), (8, 3)])
    else:
        grid = itertools.product([2, 4, 8], [256, 512], [(4, 3), (8, 3)])
    return [{"block_n": bn, "block_k": bk, "num_warps": w, "num_stages": s} for bn, bk, (w, s) in grid]


def time_graph(fn, copies, reps: int = 20) -> float:
    """Microseconds per call of fn(i) for i over the copies, from graph replays."""
    for i in range(len(copies)):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(len(copies)):
            fn(i)
    graph.replay()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (reps * len(copies)))
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the default config")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--layers", default=",".join(LAYERS))
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    for name in args.layers.split(","):
        n, k, silu = LAYERS[name]
        nbytes = n * k * 2
        copies = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
                  for _ in range(max(2, -(-600 * 2**20 // nbytes)))]
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), copies[0].float())
            if silu:
                gate, up = ref.chunk(2, dim=-1)
                ref = F.silu(gate) * up

            def cublas(i):
                out = F.linear(x, copies[i])
                return fused_ops.silu_and_mul(out) if silu else out
            base = time_graph(cublas, copies)
            row = {"layer": name, "n": n, "k": k, "rows": rows, "cublas_us": base,
                   "cublas_tbs": nbytes / base / 1e6, "configs": []}
            for cfg in configs(rows, args.quick):
                try:
                    out = gemv.gemv(x, copies[0], silu_mul=silu, config=cfg)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        row["configs"].append({**cfg, "error": err})
                        continue
                    us = time_graph(lambda i: gemv.gemv(x, copies[i], silu_mul=silu, config=cfg), copies)
                    row["configs"].append({**cfg, "us": us, "tbs": nbytes / us / 1e6, "err": err})
                except Exception as exc:        # a config the compiler rejects (e.g. out of resources)
                    row["configs"].append({**cfg, "failed": repr(exc)[:200]})
            ok = [c for c in row["configs"] if "us" in c]
            row["best"] = min(ok, key=lambda c: c["us"]) if ok else None
            dflt = gemv.default_config(rows, n, k)
            row["default_us"] = next((c["us"] for c in ok if all(c[key] == v for key, v in dflt.items())), None)
            results.append(row)
            b = row["best"]
            print(f"{name:14s} M={rows} cublas {base:7.1f} us ({row['cublas_tbs']:.2f} TB/s)  best gemv "
                  f"{b['us'] if b else float('nan'):7.1f} us ({b['tbs'] if b else 0:.2f} TB/s) {b}", flush=True)
        del copies
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemv_bench.json"), "w") as f:
            json.dump(results, f, indent=1)
    print("\n| layer | rows | cuBLAS us | cuBLAS TB/s | GEMV best us | TB/s | default cfg us | best config |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        b = r["best"] or {}
        cfg = {key: b[key] for key in ("block_n", "block_k", "num_warps", "num_stages")} if b else None
        print(f"| {r['layer']} | {r['rows']} | {r['cublas_us']:.1f} | {r['cublas_tbs']:.2f} | "
              f"{b.get('us', float('nan')):.1f} | {b.get('tbs', 0):.2f} | "
              f"{r['default_us'] if r['default_us'] is not None else float('nan'):.1f} | {cfg} |")


if __name__ == "__main__":
    main()
