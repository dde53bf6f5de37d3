"""Each qwen3-4b and nanbeige4.1-3b ("nb") decoder product with FP8 weights against bf16, by rows (scripts/device/bench_fp8.sh runs it):

  python scripts/device/fp8_products.py --out DIR      DIR/fp8_products.md (also printed)

Per shape and M input rows: bf16 (M = 1: the single-token product `gemv.fused_linear`; else `F.linear`),
FP8 as shipped (`fp8_linear`; M = 1: `gemv.fused_linear` with the scales), and for 1 < M <= ROWS_MAX also
the `_scaled_mm` W8A8 path (`quantize_rows` + `_scaled_mm`) that larger batches take, so that the few-row
kernel's range can be judged. Microseconds per product inside one CUDA graph over COPIES weight copies (weights from HBM),
checked against the dequantized float32 product before being timed (W8A8 against the product of the
row-quantized input). At M = 1 it also times the single-token product with each of CANDIDATES' tiles and
writes the fastest per shape, where it beats the shipped tile by over 3%, to DIR/fp8_best_tiles.json
(bench_fp8.py --fp8-tiles runs a model with them: `KernelConfig.fp8_tiles`).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728),
          "nb qkv": (3584, 2560), "nb o_proj": (2560, 2560), "nb gate_up": (20992, 2560), "nb down": (2560, 10496)}
ROWS = (1, 2, 4, 8, 16, 64)
COPIES = 8
SILU = {"gate_up": True, "nb gate_up": True}


def candidates():
    # FP8 single-token products run whole rows (four weights a register): (block_n, num_warps, programs_per_sm)
    from tokenmill.layers.kernel_config import WholeRowTile
    return [WholeRowTile(bn, w, p) for bn, w, p in (
        (1, 4, 6), (1, 4, 8), (2, 4, 3), (2, 4, 5), (2, 4, 8), (4, 4, 4), (4, 4, 6), (8, 4, 3), (8, 4, 4),
        (16, 4, 2), (1, 8, 4), (2, 8, 4), (4, 8, 3), (8, 8, 2), (16, 8, 2), (1, 16, 2), (2, 16, 2), (4, 16, 1),
        (8, 16, 1))]


def graph_us(fns, reps: int = 20) -> float:
    """Mean microseconds of one call of fns (run in turn) inside a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / reps / len(fns)


def write_report(out_dir: str, stem: str, lines: list[str], results) -> str:
    """A product benchmark's table (`lines`, with the commit and GPU appended) printed and written to
    out_dir/stem.md, its raw results to out_dir/stem.json; returns the table."""
    text = "\n".join(lines + ["", f"commit {os.environ.get('TOKENMILL_GIT_COMMIT', 'unknown')}, "
                                   f"{torch.cuda.get_device_name()}"])
    print(text)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1)
    return text


def main(args) -> None:
    from tokenmill.layers.kernels import gemv
    from tokenmill.layers.kernels.fp8_gemm import ROWS_MAX, fp8_linear, fp8_linear_many
    from tokenmill.layers.kernels.fp8_quantize import quantize_rows
    from tokenmill.quant import fp8

    sweep, lines_sweep, best_tiles = {}, [], []
    lines = ["## FP8 products vs bf16, qwen3-4b shapes (us per product, weights from HBM)", "",
             "| product | M | bf16 us | fp8 shipped us | fp8 `_scaled_mm` us | bf16 / fp8 shipped |", "|---|---|---|---|---|---|"]
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda").mul_(0.05) for _ in range(COPIES)]
        qs = [fp8.quantize(w) for w in ws]
        bf = [w.bfloat16() for w in ws]
        del ws
        for m in ROWS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            if m == 1:
                bf16_fn = lambda w: gemv.fused_linear(x, w)[0]
                fp8_fn = lambda q, s: gemv.fused_linear(x, q, weight_scale=s, weight_block=(1, k))[0]
            else:
                bf16_fn = lambda w: F.linear(x, w)
                fp8_fn = lambda q, s: fp8_linear(x, q, s, (1, k))

            def w8a8(q, s):
                return fp8_linear_many(x, q, s, (1, k))
            w_ref = fp8.dequantize(*qs[0], (1, k)).t()
            want = x.float() @ w_ref
            xq, xs = quantize_rows(x)
            want_q = (xq.float() * xs) @ w_ref
            # the shipped path from two rows on is W8A8 (per-channel scales)
            shipped_ref = want if m == 1 else want_q
            for label, fn, ref in (("fp8 shipped", fp8_fn, shipped_ref), ("W8A8", w8a8, want_q)):
                err = ((fn(*qs[0]).float() - ref).abs().max() / ref.abs().mean()).item()
                if err > 0.1:
                    raise SystemExit(f"{name} M={m} {label}: relative error {err:.3f}")
            bf16_us = graph_us([lambda w=w: bf16_fn(w) for w in bf])
            fp8_us = graph_us([lambda q=q: fp8_fn(*q) for q in qs])
            if m == 1:
                sweep[name] = swept = {}
                for tile in candidates():
                    run = lambda q, s, t=tile: gemv.fused_linear(x, q, weight_scale=s, weight_block=(1, k), tile=t,
                                                                 act="silu" if name in SILU else None)[0]
                    try:
                        got = run(*qs[0]).float()
                        ref = want if name not in SILU else F.silu(want[:, :n // 2]) * want[:, n // 2:]
                        if (got - ref).abs().max() / ref.abs().max() > 0.02:
                            swept[repr(tile)] = "WRONG"
                            continue
                        swept[repr(tile)] = graph_us([lambda q=q: run(*q) for q in qs])
                    except Exception as e:       # a tile that does not fit the shape: named, not fatal
                        swept[repr(tile)] = f"ERROR {type(e).__name__}: {str(e)[:100]}"
                timed = {t: v for t, v in swept.items() if isinstance(v, float)}
                shipped = graph_us([lambda q=q, s=s: gemv.fused_linear(x, q, weight_scale=s, weight_block=(1, k),
                                                                  act="silu" if name in SILU else None)[0]
                                            for q, s in qs])
                best = min(timed, key=timed.get) if timed else None
                lines_sweep.append(f"| {name} {n}x{k} | {shipped:.2f} | {best} | "
                                   f"{timed[best]:.2f} | {shipped / timed[best]:.2f}x |" if best else
                                   f"| {name} | {shipped:.2f} | none | - | - |")
                if best and timed[best] < shipped / 1.03:
                    best_tiles.append([[n, k, SILU.get(name, False)], best])
                with open(os.path.join(args.out, "fp8_best_tiles.json"), "w") as f:     # so far
                    json.dump(best_tiles, f)
            w8a8_us = graph_us([lambda q=q: w8a8(*q) for q in qs]) if 1 < m <= ROWS_MAX else None
            lines.append(f"| {name} {n}x{k} | {m} | {bf16_us:.2f} | {fp8_us:.2f} | "
                         f"{'-' if w8a8_us is None else f'{w8a8_us:.2f}'} | {bf16_us / fp8_us:.2f}x |")
        del qs, bf
        torch.cuda.empty_cache()
    lines += ["", f"M = 1: single-token products; 1 < M <= {ROWS_MAX}: the few-row W8A8 kernel (shipped) "
              "beside `_scaled_mm`; larger M: `_scaled_mm` (shipped)"]
    lines += ["", "## M = 1 single-token FP8 tiles (us, with SiLU-and-mul for gate_up)", "",
              "| product | shipped us | best tile | best us | shipped / best |", "|---|---|---|---|---|",
              *lines_sweep]
    text = "\n".join(lines)
    with open(os.path.join(args.out, "fp8_best_tiles.json"), "w") as f:
        json.dump(best_tiles, f)
    with open(os.path.join(args.out, "fp8_tile_sweep.json"), "w") as f:
        json.dump(sweep, f, indent=1)
    print(text)
    with open(os.path.join(args.out, "fp8_products.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    main(p.parse_args())
