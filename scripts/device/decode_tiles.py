"""Single-row product tiles timed where they run: the batch-1 decode CUDA graph captured again for each
variant (one product's tile changed from the shipped one), the variants' replays timed in turns, side by
side in one process, and the median of each kept. A product timed alone can mislead: qwen3-4b's AWQ o_proj
gained 0.8 us alone with 4 rows a program and 2.7 us a layer in the model (docs/BENCHMARKS.md, "W4 GEMV at
one row"). Each variant's logits are compared with the shipped tiles' (same input, same step), so a tile
that computes something else shows.

  --weights awq   the AWQ g128 model (quantized into /tmp as bench_w4.py does); the W4 GEMV's tiles
                  (`w4_gemm.gemv_tile`, block_n x block_w words x num_warps)
  --weights fp8   the model quantized to FP8 at load; the single-token products' whole-row tiles
                  (`KernelConfig.fp8_tiles`, block_n x num_warps x programs_per_sm)
  --weights bf16  the bf16 model; the single-token products' tiles (`KernelConfig.tiles`), varied over
                  whole-row tiles as for FP8 (a shipped register or shared-memory tile included)

  --attention     the decode attention's launch instead (`attention_variants`: split caps, pipelining)

  --vary "NxK[ silu],..."      vary only these products' tiles
  --combine "NxK[ silu]=a,b,c"  (repeatable) one more variant with all these products' tiles changed together:
                                whether the winners of single changes add up

  python scripts/device/decode_tiles.py --model qwen3-4b --weights awq --out DIR   DIR/decode_tiles-<weights>-<model>.md

The engine is built as the engine's graphs see it (4,096 positions: the batch-1 decode attention's 32
splits) and the timed step attends to --context positions (160).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_w4 import awq_preset  # noqa: E402
from profile_decode import replay_ms  # noqa: E402

# max_model_len as the engine's graphs see it: the batch-1 decode attention's split count follows the block
# table's width (32 splits from 4,096 positions on, the engine's and profile_decode.py's; 1,024 gave 16, a
# launch of the other pipelining depth, `DecodeAttentionConfig.many_splits`)
MAX_MODEL_LEN = 4096
W4_CANDIDATES = ((4, 512, 4), (8, 512, 4), (16, 512, 4), (4, 256, 2), (8, 256, 2), (8, 128, 1), (8, 1024, 8))
BF16_CANDIDATES = ((1, 4, 4), (1, 4, 5), (1, 4, 6), (1, 4, 7), (2, 4, 3), (2, 4, 4), (2, 4, 5), (2, 4, 6), (1, 8, 3),
                   (1, 8, 4), (2, 8, 3), (1, 16, 2), (2, 16, 2))
FP8_CANDIDATES = ((1, 4, 4), (1, 4, 5), (1, 4, 6), (2, 4, 3), (2, 4, 4), (2, 4, 5), (2, 4, 6), (4, 4, 2), (4, 4, 3),
                  (4, 4, 4), (4, 4, 5), (8, 4, 3), (2, 8, 4), (4, 8, 2), (1, 16, 2), (2, 16, 2))


def shape_key(key) -> str:
    """"NxK" for a W4 product's (N, K), "NxK" or "NxK silu" for an FP8 product's (N, K, SiLU-and-mul after)."""
    return f"{key[0]}x{key[1]}" + (" silu" if len(key) > 2 and key[2] else "")


def parse_tiles(specs) -> dict:
    """--combine's "NxK[ silu]=a,b,c" specs -> {shape_key: (a, b, c)}."""
    out = {}
    for spec in specs:
        shape, tile = spec.split("=")
        out[shape.strip()] = tuple(int(v) for v in tile.split(","))
    return out


def tile_variants(keys, shipped, candidates, tile_type, setter, vary, combine):
    """({name: setter}, the setter that restores the shipped tiles, the shipped tiles by shape): "shipped",
    then each candidate tile (`tile_type(*t)`) of each product in `vary` (None: every one) that is not its
    shipped tile, the `combine` tiles together if any, and "shipped again". `setter(tiles)`: a function
    that, called, makes the products in `tiles` ({key: tile}) run that tile and the others the shipped."""
    variants = {"shipped": setter({})}
    for key in keys:
        for t in candidates if vary is None or shape_key(key) in vary else ():
            if tile_type(*t) != shipped[key]:
                variants[f"{shape_key(key)} {t}"] = setter({key: tile_type(*t)})
    if combine:
        variants[f"together: {combine}"] = setter({key: tile_type(*combine[shape_key(key)])
                                                   for key in keys if shape_key(key) in combine})
    variants["shipped again"] = setter({})
    return variants, setter({}), {shape_key(key): str(t) for key, t in shipped.items()}


def w4_variants(runner, vary, combine):
    """`tile_variants` of the W4 products' tiles at one row, the others the rule's (`w4_gemm.gemv_tile`)."""
    from tokenmill.layers.kernels import w4_gemm
    from tokenmill.layers.quantized import W4Linear
    shapes = sorted({(m.out_features, m.in_features) for m in runner.model.modules() if isinstance(m, W4Linear)})
    original = w4_gemm.gemv_tile
    shipped = {s: original(*s, 1, torch.device("cuda")) for s in shapes}

    def setter(tiles):
        def apply():
            w4_gemm.gemv_tile = lambda n, k, m, dev: (tiles[(n, k)] if m == 1 and (n, k) in tiles
                                                      else original(n, k, m, dev))
        return apply
    return tile_variants(shapes, shipped, W4_CANDIDATES, w4_gemm.W4GemvTile, setter, vary, combine)


def whole_row_variants(runner, fp8: bool, vary, combine):
    """`tile_variants` of the fused single-token products (`gemv.fused_linear`): each setter gives the
    backend a KernelConfig with one product's whole-row tile, in `fp8_tiles` for FP8 weights (the shipped
    tile as fused_linear picks it: the shape's entry, else `gemv_whole.fp8_tile` of the 16-bit tile), in `tiles`
    for bf16 (whatever tile type the shape ships with)."""
    from torch import nn
    from tokenmill.layers.fp8_linear import Fp8Linear
    from tokenmill.layers.kernel_config import WholeRowTile
    from tokenmill.layers.kernels import gemv_whole
    backend = runner.model.model.backend
    base = backend.kernels
    field, kind, candidates = (("fp8_tiles", Fp8Linear, FP8_CANDIDATES) if fp8
                               else ("tiles", nn.Linear, BF16_CANDIDATES))
    products = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    keys = sorted({(*m.weight.shape, name.endswith("gate_up_proj"))      # (N, K, SiLU-and-mul after it)
                   for name, m in runner.model.named_modules()
                   if isinstance(m, kind) and name.rpartition(".")[2] in products})
    shipped = {key: gemv_whole.fp8_tile_of(base, *key) if fp8 else base.tile(*key) for key in keys}

    def setter(extra):
        def apply():
            tiles = {**dict(getattr(base, field)), **extra}
            backend.kernels = dataclasses.replace(base, **{field: tuple(tiles.items())})
        return apply
    return tile_variants(keys, shipped, candidates, WholeRowTile, setter, vary, combine)


def attention_variants(runner):
    """The batch-1 decode attention's launch beside the shipped one ({name: setter}, the restoring setter,
    the shipped config): the split count capped at 16 and 8 (`decode_attention.MAX_SPLITS`; the engine's
    graphs run 32 splits a kv head at batch 1, most of them holding no position at short contexts), and the
    32-split launch at the pipelining depth of fewer splits (`many_splits_stages` 2)."""
    from tokenmill.layers.kernels import decode_attention as da
    backend = runner.model.model.backend
    base, base_max = backend.kernels, da.MAX_SPLITS

    def setter(max_splits=base_max, **config):
        def apply():
            da.MAX_SPLITS = max_splits
            backend.kernels = dataclasses.replace(base, decode_attention=dataclasses.replace(base.decode_attention,
                                                                                             **config))
        return apply
    variants = {"shipped": setter(), "max 16 splits": setter(16), "max 16 splits, one stage": setter(16, many_splits=16),
                "max 8 splits": setter(8), "32 splits, two stages": setter(many_splits_stages=2),
                "shipped again": setter()}
    return variants, setter(), {"decode_attention": str(base.decode_attention), "MAX_SPLITS": base_max}


def main(args) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.models.presets import resolve_model_path

    if args.weights == "awq":
        path, extra = awq_preset(args.model)[1], {}
    else:
        path = resolve_model_path(f"preset:{args.model}", "bfloat16", 0)
        extra = dict(quantization="fp8") if args.weights == "fp8" else {}
    llm = LLM(path, dtype="bfloat16", max_num_seqs=8, max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=0.35,
              **extra)
    # the graph's static inputs are those of the last decode step: a context of args.context positions
    llm.generate([[100 + j for j in range(args.context - 16)]],
                 SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    runner = llm.engine.runner
    vary = None if args.vary is None else {v.strip() for v in args.vary.split(",")}
    if args.attention:
        variants, restore, shipped = attention_variants(runner)
    elif args.weights == "awq":
        variants, restore, shipped = w4_variants(runner, vary, parse_tiles(args.combine))
    else:
        variants, restore, shipped = whole_row_variants(runner, args.weights == "fp8", vary, parse_tiles(args.combine))
    forward = runner.graph_runner.static_forward(("decode", 1))
    graphs, logits = {}, {}
    for name, apply in variants.items():
        apply()
        try:
            forward()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits[name] = forward()[1]     # the graph's own output buffer, written at each replay
            graphs[name] = graph
        except Exception as e:      # a tile that does not compile or fit: named, not fatal
            print(json.dumps({"variant": name, "skipped": repr(e)[-300:]}), flush=True)
    restore()
    times = {name: [] for name in graphs}
    for _ in range(args.rounds):
        for name, graph in graphs.items():
            times[name].append(replay_ms(graph))
    # every variant computes the same step: its logits against the shipped tiles' (the same input, so only
    # the products' summation order differs), the largest difference over the largest logit
    ref = logits["shipped"].float()
    for name in graphs:
        graphs[name].replay()
    torch.cuda.synchronize()
    diff = {name: ((logits[name].float() - ref).abs().max() / ref.abs().max()).item() for name in graphs}
    same_top = {name: bool((logits[name].argmax(-1) == ref.argmax(-1)).all()) for name in graphs}
    rows = [{"variant": name, "graph_replay_ms": sorted(t)[len(t) // 2], "all_ms": t,
             "logits_rel_diff": diff[name], "same_top1": same_top[name]} for name, t in times.items()]
    base = min(r["graph_replay_ms"] for r in rows if r["variant"].startswith("shipped"))
    what = "Decode attention launches" if args.attention else "Single-row product tiles"
    lines = [f"# {what} in the batch-1 decode graph: {args.model}, {args.weights}", "",
             f"shipped: {json.dumps(shipped)}", "",
             "| variant | graph replay ms (median) | vs shipped | logits max diff / max "
             "| same top-1 |",
             "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["graph_replay_ms"]):
        lines.append(f"| {r['variant']} | {r['graph_replay_ms']:.4f} | {r['graph_replay_ms'] - base:+.4f} | "
                     f"{r['logits_rel_diff']:.1e} | {'yes' if r['same_top1'] else 'NO'} |")
    lines += ["", f"commit {os.environ.get('TOKENMILL_GIT_COMMIT', 'unknown')}, {torch.cuda.get_device_name()}, "
              f"{args.rounds} turns, context {args.context} positions, max_model_len {MAX_MODEL_LEN}"]
    text = "\n".join(lines)
    print(text)
    stem = os.path.join(args.out, f"decode_tiles-{args.weights}-{args.model}{'-attention' if args.attention else ''}"
                                  f"{args.suffix}")
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    with open(stem + ".json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--weights", choices=("awq", "fp8", "bf16"), default="awq")
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--context", type=int, default=160,
                   help="positions in the timed step's context (160: the mean of bench_fp8.py's 32 in / 256 out)")
    p.add_argument("--suffix", default="", help="appended to the output files' names")
    p.add_argument("--attention", action="store_true",
                   help="vary the decode attention's split count and pipelining instead of the products' tiles")
    p.add_argument("--vary", help="the products whose tile is varied, as \"NxK[ silu],...\" (default: every one)")
    p.add_argument("--combine", action="append", default=[], metavar="\"NxK[ silu]=a,b,c\"",
                   help="one more variant with each of these products' tiles changed together")
    main(p.parse_args())
