"""FP8 products at 2-64 input rows on one GPU: the tensor-core few-row kernel (`fp8_gemm.fp8_rows`) against
the other FP8 paths and bf16, then in a decoding model.

  python scripts/device/fp8_rows.py --out DIR [--stages products,decode]
                                           DIR/fp8_rows.md (also printed), DIR/fp8_rows.json

1. Each qwen3-4b product (per-channel scales, and 128 x 128 block scales), M in ROWS: bf16 `F.linear`,
   the path above ROWS_MAX rows (per channel W8A8 `quantize_rows` + `_scaled_mm`; block scales dequantize
   + `F.linear`) and `fp8_rows` with each of TILES (the split of `rows_tile`'s rule for that block_n, and
   twice it), microseconds per product inside one CUDA graph over COPIES weight copies, each checked
   first against the product of the row-quantized input.
2. --model (preset:qwen3-4b) decoding BATCHES requests (32 in, 128 out, greedy), ms per step: bf16, then
   --quantization fp8 with `fp8_rows` on the previous tile rule (`previous_rows_tile`), then as shipped.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from fp8_products import graph_us, write_report     # this folder: the script's own

SHAPES = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
ROWS = (2, 8, 16, 64)
COPIES = 8
TILES = ((128, 128, 4, 4), (128, 256, 4, 3), (64, 128, 4, 4))
BATCHES = (8, 32, 64)


def products(lines, results):
    from tokenmill.layers.kernels import fp8_gemm
    from tokenmill.layers.kernels.fp8_gemm import Fp8RowsTile, fp8_rows, rows_tile
    from tokenmill.layers.kernels.fp8_quantize import quantize_rows_torch
    from tokenmill.quant import fp8
    lines += ["## FP8 products at 2-64 rows, qwen3-4b shapes (us per product, weights from HBM)", "",
              "| product | scales | M | bf16 | fp8 above ROWS_MAX's path | fp8_rows best | best tile | "
              "that path / best | bf16 / best |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda").mul_(0.05) for _ in range(COPIES)]
        bf = [w.bfloat16() for w in ws]
        for block in (None, (128, 128)):
            qs = [fp8.quantize(w, block) for w in ws]
            blk = block or (1, k)
            w_ref = fp8.dequantize(*qs[0], blk).t()
            for m in ROWS:
                x = torch.randn(m, k, device="cuda").bfloat16()
                xq, xs = quantize_rows_torch(x)
                want = (xq.float() * xs) @ w_ref
                base = rows_tile(n, blk, x.device)
                row = {}
                for bn, bk, w, st in TILES:
                    split = max(1, -(-torch.cuda.get_device_properties(0).multi_processor_count // -(-n // bn)))
                    for s in (split, 2 * split):
                        tile = Fp8RowsTile(bn, bk, w, st, s)
                        if block and (block[0] % bn or block[1] % bk):
                            continue
                        got = fp8_rows(x, *qs[0], blk, tile=tile).float()
                        err = ((got - want).abs().max() / want.abs().mean()).item()
                        row[repr(tile)] = graph_us([lambda q=q, t=tile: fp8_rows(x, *q, blk, tile=t) for q in qs]) \
                            if err < 0.05 else f"WRONG {err:.3f}"
                shipped = graph_us([lambda q=q: fp8_gemm.fp8_linear_many(x, *q, blk) for q in qs])
                bf16 = graph_us([lambda w=w: F.linear(x, w) for w in bf])
                timed = {t: v for t, v in row.items() if isinstance(v, float)}
                best = min(timed, key=timed.get)
                results.append(dict(product=name, n=n, k=k, block=block, m=m, bf16_us=bf16, shipped_us=shipped,
                                    tiles=row, default_tile=repr(base)))
                lines.append(f"| {name} | {'128x128' if block else 'channel'} | {m} | {bf16:.2f} | {shipped:.2f} | "
                             f"{timed[best]:.2f} | {best.replace('Fp8RowsTile', '')} | {shipped / timed[best]:.2f}x | "
                             f"{bf16 / timed[best]:.2f}x |")
                print(lines[-1], "default", repr(base), row.get(repr(base)), flush=True)
            del qs
        del ws, bf
        torch.cuda.empty_cache()


def previous_rows_tile(n, block, device, m=1):
    """`fp8_gemm.rows_tile` before 256-column steps and the halved split (commit 9821d28): 128-column steps,
    the split that fills the SMs about once, at every row count."""
    from tokenmill.layers.kernels.fp8_gemm import Fp8RowsTile, ROWS_BLOCK_M, _num_sms
    block_n, block_k = 64, 128
    if block[0] != 1:
        block_n = next((b for b in (64, 32, 16) if block[0] % b == 0), None)
        block_k = next((b for b in (128, 64, 32) if block[1] % b == 0), None)
        if block_n is None or block_k is None:
            return None
    tiles = -(-n // block_n) * -(-m // ROWS_BLOCK_M)
    return Fp8RowsTile(block_n, block_k, 4, 4, max(1, -(-_num_sms(device) // tiles)))


def decode(lines, results, model):
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.kernels import fp8_gemm
    from tokenmill.models.presets import resolve_model_path
    path = resolve_model_path(model)
    shipped = fp8_gemm.rows_tile
    lines += ["", f"## {model} decoding (32 in, 128 out, greedy), ms per step", "",
              "| batch | bf16 | fp8, the previous `rows_tile` | fp8 shipped | previous / shipped | bf16 / shipped |",
              "|---|---|---|---|---|---|"]
    timings = {}
    for label, rule in (("bf16", shipped), ("previous", previous_rows_tile), ("shipped", shipped)):
        fp8_gemm.rows_tile = rule
        llm = LLM(path, quantization=None if label == "bf16" else "fp8", num_kv_blocks=4096, max_num_seqs=64)
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        for b in BATCHES:
            prompts = [[(17 * i + 5 * j) % 50000 + 100 for i in range(32)] for j in range(b)]
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            ms = [1e3 * (o.metrics.last_token_time - o.metrics.first_token_time) / 127 for o in outs]
            timings[(label, b)] = (sum(ms) / len(ms), [o.outputs[0].token_ids[:8] for o in outs[:2]])
            print(label, b, timings[(label, b)][0], time.perf_counter() - t0, flush=True)
        del llm
        torch.cuda.empty_cache()
    fp8_gemm.rows_tile = shipped
    for b in BATCHES:
        h, a, r = (timings[(label, b)][0] for label in ("bf16", "previous", "shipped"))
        same = timings[("previous", b)][1] == timings[("shipped", b)][1]
        lines.append(f"| {b} | {h:.3f} | {a:.3f} | {r:.3f} | {a / r:.3f}x | {h / r:.3f}x |"
                     + ("" if same else " (the two FP8 runs' first tokens differ)"))
        results.append(dict(batch=b, bf16_ms=h, previous_ms=a, shipped_ms=r, same_first_tokens=same))


def main(args) -> None:
    lines, results = [], []
    try:
        if "products" in args.stages:
            products(lines, results)
        if "decode" in args.stages:
            decode(lines, results, args.model)
    finally:
        write_report(args.out, "fp8_rows", lines, results)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stages", default="products,decode")
    p.add_argument("--model", default="preset:qwen3-4b", help="the decode stage's model")
    main(p.parse_args())
