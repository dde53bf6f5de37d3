"""Decode attention between the products, as a decode step runs it, on the GPU machine.

Per variant, one CUDA graph of 36 layers, each: the qkv product (single-token GEMV), attention, the
o_proj product, at real model shapes and one sequence per row, every layer with its own weights and KV
cache. Variants of the one-kernel attention (`decode_attention.fused_decode_attention`): `shipped` (its
default launch) and launches written MIN[wWARPS][sSTAGES][bBLOCK_N]: `min_split_len` MIN, `num_warps`
WARPS, `num_stages` STAGES for every launch, `block_n` BLOCK_N (the rest `DecodeAttentionConfig`'s
defaults, for every batch). Prints microseconds per layer and writes them to
$OUT/decode_attention_bench.json. (The three-kernel path it was first measured against is gone; its
figures are in docs/BENCHMARKS.md.)

Usage: python lab/decode_attention_bench.py --out DIR [--contexts 160,1000,4000] [--batches 1,8]
       [--min-split-lens 64,128,64w8,64s1,32s1b32]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

from tokenmill.layers.kernel_config import DecodeAttentionConfig
from tokenmill.layers.kernels import decode_attention, gemv
from tokenmill.layers.rotary import RotaryEmbedding

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "device"))
from profile_decode import replay_ms  # noqa: E402

SHAPES = {"qwen3-4b": (2560, 32, 8, True), "nanbeige4.1-3b": (2560, 20, 4, False)}
LAYERS, BLOCK, HEAD_DIM = 36, 16, 128


def build(model: str, batch: int, ctx: int):
    hidden, hq, hkv, qk_norm = SHAPES[model]
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    width = (hq + 2 * hkv) * HEAD_DIM
    blocks_per_seq = -(-(ctx + 1) // BLOCK)
    layers = []
    for _ in range(LAYERS):
        layers.append(dict(
            w_qkv=torch.randn(width, hidden, device=dev, dtype=bf16, generator=gen) / 50,
            w_o=torch.randn(hidden, hq * HEAD_DIM, device=dev, dtype=bf16, generator=gen) / 64,
            k=torch.randn(batch * blocks_per_seq, BLOCK, hkv, HEAD_DIM, device=dev, dtype=bf16, generator=gen),
            v=torch.randn(batch * blocks_per_seq, BLOCK, hkv, HEAD_DIM, device=dev, dtype=bf16, generator=gen),
            qw=torch.randn(HEAD_DIM, device=dev, dtype=bf16, generator=gen) if qk_norm else None,
            kw=torch.randn(HEAD_DIM, device=dev, dtype=bf16, generator=gen) if qk_norm else None))
    table = torch.randperm(batch * blocks_per_seq, device=dev).int().view(batch, blocks_per_seq)
    ctx_t = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    positions = torch.full((batch,), ctx - 1, dtype=torch.int64, device=dev)
    slots = table[:, (ctx - 1) // BLOCK].long() * BLOCK + (ctx - 1) % BLOCK
    rope = RotaryEmbedding(HEAD_DIM, 8192, 1e6).to(dev)
    x = torch.randn(batch, hidden, device=dev, dtype=bf16, generator=gen)
    return dict(layers=layers, table=table, ctx=ctx_t, positions=positions, slots=slots, cos_sin=rope.cos_sin,
                x=x, hq=hq, hkv=hkv)


def attention_config(variant: str) -> DecodeAttentionConfig | None:
    """"64w8s1b32" -> DecodeAttentionConfig(min_split_len=64, num_warps=8, num_stages=1, block_n=32); each of
    w, s and b optional, in that order. "shipped" -> None (the kernel's default launch)."""
    if variant == "shipped":
        return None
    m = re.fullmatch(r"(\d+)(?:w(\d+))?(?:s(\d+))?(?:b(\d+))?", variant)
    if m is None:
        raise ValueError(f"attention variant {variant!r} is not MIN[wWARPS][sSTAGES][bBLOCK_N]")
    cfg = {"min_split_len": int(m.group(1))}
    for key, value in zip(("num_warps", "num_stages", "block_n"), m.groups()[1:]):
        if value:
            cfg[key] = int(value)
    if "num_stages" in cfg:     # every launch, also those with `many_splits` splits
        cfg["many_splits_stages"] = cfg["num_stages"]
    return DecodeAttentionConfig(**cfg)


def step(s, variant, o_proj=None):
    """One pass over the layers; `o_proj(attn, w_o)` replaces the batch-1 o_proj product if given."""
    x = s["x"]
    hq, hkv = s["hq"], s["hkv"]
    for L in s["layers"]:
        qkv = gemv.fused_linear(x, L["w_qkv"])[0] if x.shape[0] == 1 else x @ L["w_qkv"].t()
        attn = decode_attention.fused_decode_attention(
            qkv, s["positions"], s["cos_sin"], L["qw"], L["kw"], 1e-6, L["k"], L["v"], s["slots"], s["table"],
            s["ctx"], HEAD_DIM ** -0.5, hq, hkv, HEAD_DIM, config=attention_config(variant))
        attn = attn.reshape(x.shape[0], -1)
        if o_proj is not None and x.shape[0] == 1:
            x = o_proj(attn, L["w_o"])
        else:
            x = gemv.fused_linear(attn, L["w_o"])[0] if x.shape[0] == 1 else attn @ L["w_o"].t()
    return x


def time_graph(s, variant, iters=50, o_proj=None) -> float:
    out = step(s, variant, o_proj)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(s, variant, o_proj)
    ms = replay_ms(graph, iters)
    del out
    return ms * 1000 / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default="qwen3-4b,nanbeige4.1-3b")
    ap.add_argument("--contexts", default="160,1000,4000")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--min-split-lens", default="64,128,256")
    args = ap.parse_args()
    variants = ["shipped"] + args.min_split_lens.split(",")
    rows = []
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for ctx in (int(c) for c in args.contexts.split(",")):
                s = build(model, batch, ctx)
                res = {v: time_graph(s, v) for v in variants}
                rows.append(dict(model=model, batch=batch, ctx=ctx, us_per_layer={str(k): v for k, v in res.items()}))
                print(json.dumps(rows[-1]), flush=True)
                del s
                torch.cuda.empty_cache()
    with open(os.path.join(args.out, "decode_attention_bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    head = ["shipped"] + [f"min split {v}" for v in variants[1:]]
    print("\n| model | batch | context | " + " | ".join(head) + " |")
    print("|---|---|---|" + "---|" * len(head))
    for r in rows:
        cells = " | ".join(f"{r['us_per_layer'][str(v)]:.2f}" for v in variants)
        print(f"| {r['model']} | {r['batch']} | {r['ctx']} | {cells} |")
    print("\n(us per layer: qkv product + attention + o_proj product, 36 layers in one CUDA graph)")


if __name__ == "__main__":
    main()
