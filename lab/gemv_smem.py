"""Single-token products with shared-memory tiles (`tokenmill.layers.kernels.gemv_smem`: each program
copies its whole row block to shared memory before its programmatic-dependent-launch wait) against the
tiles the products use now, on the GPU machine.

For each product of a layer (qkv with its norm and residual, o, gate_up with its norm and SiLU-and-mul,
down), one CUDA graph launches it once per layer over the layer's own weight copy, as gemv_bench.py
does, so weights come from HBM and each launch overlaps the one before as in a decode step. Prints us
per product and TB/s for the current tile and each shared-memory tile that fits, and writes
$OUT/gemv_smem.json. Where the products meet attention, the batch-1 decode graph itself is the
measure: scripts/device/decode_tiles.py.

Usage: python lab/gemv_smem.py [--models qwen3-4b] [--tiles 2x512x2,4x512x4,...]
"""
from __future__ import annotations

import argparse
import json
import os

import torch


def main() -> None:
    from gemv_bench import graph_us, products, write_rows    # lab/, the script's own folder
    from tokenmill.layers.kernel_config import SmemTile
    from tokenmill.layers.kernels import gemv, gemv_smem

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default="qwen3-4b")
    ap.add_argument("--tiles", default="2x512x2,4x512x4,8x512x8,8x1024x8,2x256x2,4x256x4",
                    help="shared-memory tiles, block_n x block_k x warps")
    args = ap.parse_args()
    tiles = [SmemTile(*(int(v) for v in t.split("x"))) for t in args.tiles.split(",")]
    bf16 = torch.bfloat16
    rows = []
    for model in args.models.split(","):
        layers, prods = products(model)
        gen = torch.Generator(device="cuda").manual_seed(0)
        for name, (n, k), norm, silu in prods:
            ws = [torch.randn(n, k, device="cuda", dtype=bf16, generator=gen) / 50 for _ in range(layers)]
            x = torch.randn(1, k, device="cuda", dtype=bf16, generator=gen)
            kw = dict(act="silu" if silu else None)
            if norm:
                kw.update(norm_weight=1 + torch.randn(k, device="cuda", dtype=bf16, generator=gen) / 10, eps=1e-6,
                          residual=torch.randn(1, k, device="cuda", dtype=bf16, generator=gen))
            ref = gemv.fused_linear_torch(x, ws[0], **kw)[0].float()
            current = gemv.SHIPPED.tile(n, k, silu)
            for tile in [current] + [t for t in tiles if gemv_smem.check_tile(n, k, silu, bf16, t) is None]:
                err = (gemv.fused_linear(x, ws[0], tile=tile, **kw)[0].float() - ref).abs().max().item()
                us = graph_us(lambda: [gemv.fused_linear(x, w, tile=tile, **kw) for w in ws]) / layers
                row = dict(model=model, product=name, n=n, k=k, tile=repr(tile), current=tile == current,
                           us=us, tb_s=n * k * 2 / us / 1e6, max_abs_err=err)
                rows.append(row)
                print(json.dumps(row), flush=True)
            ws = None
            torch.cuda.empty_cache()
    write_rows(args.out, "gemv_smem", rows, ["model", "product (N x K)", "tile", "us", "TB/s", "max abs err vs torch"],
               lambda r: [r["model"], f"{r['product']} {r['n']} x {r['k']}",
                          r["tile"] + (" (current)" if r["current"] else ""),
                          f"{r['us']:.2f}", f"{r['tb_s']:.2f}", f"{r['max_abs_err']:.3g}"])
    print("\n(one launch per layer, each over its own weight copy, in one CUDA graph; us per launch)")


if __name__ == "__main__":
    main()
