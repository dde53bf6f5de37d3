"""Where a single-token product tile loses bandwidth, on the GPU machine: each (N x K, kind) shape given,
with each tile given (register, "smem" or "tma" tiles of `gemv.fused_linear`), as one CUDA graph that
launches the product once per weight copy (enough copies to leave L2 behind). Prints us per launch and
TB/s, and the row blocks per program the tile gives (an uneven split shows as a slow tile).

Usage: python scripts/device/gemv_tma_probe.py --shapes 6144x2560xn,19456x2560xp --tiles 4,1024,4,8/tma,16,8,4
(kinds: p plain, n RMSNorm + residual before, s norm, residual and SiLU-and-mul)
"""
from __future__ import annotations

import argparse
import json
import os

import torch


def main() -> None:
    from gemv_bench import graph_us    # scripts/device/, the script's own folder
    from tokenmill.layers.kernels import gemv

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", required=True)
    ap.add_argument("--tiles", required=True, help="tiles separated by /, elements by commas")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    tiles = [tuple(v if v in ("smem", "tma") else int(v) for v in t.split(",")) for t in args.tiles.split("/")]
    bf16 = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape in args.shapes.split(","):
        n, k, kind = shape.split("x")
        n, k = int(n), int(k)
        copies = max(2, int(200e6 // (n * k * 2)) + 1)
        ws = [torch.randn(n, k, device="cuda", dtype=bf16, generator=gen) / 50 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=bf16, generator=gen)
        kw = dict(silu=kind == "s")
        if kind in "ns":
            kw.update(norm_weight=1 + torch.randn(k, device="cuda", dtype=bf16, generator=gen) / 10, eps=1e-6,
                      residual=torch.randn(1, k, device="cuda", dtype=bf16, generator=gen))
        ref = gemv.fused_linear_torch(x, ws[0], **kw)[0].float()
        for tile in tiles:
            try:
                err = (gemv.fused_linear(x, ws[0], config=tile, **kw)[0].float() - ref).abs().max().item()
            except ValueError as e:
                print(f"{shape} {tile}: {e}")
                continue
            us = graph_us(lambda: [gemv.fused_linear(x, w, config=tile, **kw) for w in ws]) / copies
            n_out = n // 2 if kind == "s" else n
            per_program = None
            if tile[0] == "tma":
                blocks = -(-n_out // tile[1])
                programs = min(blocks, sms * (tile[4] if len(tile) > 4 else 1))
                per_program = [blocks // programs, -(-blocks // programs)]
            row = dict(shape=shape, tile=list(tile), us=us, tb_s=n * k * 2 / us / 1e6, max_abs_err=err,
                       row_blocks_per_program=per_program)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "gemv_tma_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n| shape | tile | us | TB/s | row blocks per program | max abs err |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {', '.join(map(str, r['tile']))} | {r['us']:.2f} | {r['tb_s']:.2f} | "
              f"{r['row_blocks_per_program']} | {r['max_abs_err']:.3g} |")


if __name__ == "__main__":
    main()
