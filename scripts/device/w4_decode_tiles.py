"""The W4 GEMV's tiles timed where they run: the batch-1 decode CUDA graph of an AWQ g128 model captured again
for each variant (one product's tile changed from the shipped rule, `w4_gemm.gemv_tile`), the variants'
replays timed in turns, side by side in one process, and the median of each kept. A product timed alone
can mislead: qwen3-4b's o_proj gained 0.8 us alone with 4 rows a program and 2.7 us a layer in the model
(docs/BENCHMARKS.md, "W4 GEMV at one row").

  python scripts/device/w4_decode_tiles.py --model qwen3-4b --out DIR      DIR/w4_decode_tiles-<model>.md (+ .json)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_w4 import quantize_preset  # noqa: E402
from profile_decode import replay_ms  # noqa: E402

# (block_n, block_w, num_warps): W4GemvTile's fields
CANDIDATES = ((4, 512, 4), (8, 512, 4), (16, 512, 4), (4, 256, 2), (8, 256, 2), (8, 128, 1), (8, 1024, 8))


def main(args) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.kernels import w4_gemm
    from tokenmill.layers.quantized import W4Linear
    from tokenmill.models.presets import resolve_model_path

    bf16 = resolve_model_path(f"preset:{args.model}", "bfloat16", 0)
    awq = f"/tmp/tokenmill-w4/{args.model}-awq-g128"
    quantize_preset(bf16, awq)
    llm = LLM(awq, dtype="bfloat16", max_num_seqs=8, max_model_len=1024, gpu_memory_utilization=0.35)
    llm.generate([[100 + j for j in range(32)]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    runner = llm.engine.runner
    shapes = sorted({(m.out_features, m.in_features) for m in runner.model.modules() if isinstance(m, W4Linear)})
    device = torch.device("cuda")
    shipped = {shape: w4_gemm.gemv_tile(*shape, 1, device) for shape in shapes}
    variants = {"shipped": {}}
    for shape in shapes:
        for t in CANDIDATES:
            tile = w4_gemm.W4GemvTile(*t)
            if tile != shipped[shape]:
                variants[f"{shape[0]}x{shape[1]} {t}"] = {shape: tile}
    variants["shipped again"] = {}

    original = w4_gemm.gemv_tile
    forward = runner.graph_runner.static_forward(("decode", 1))
    graphs = {}
    for name, tiles in variants.items():
        w4_gemm.gemv_tile = lambda n, k, m, dev, _t=tiles: _t[(n, k)] if m == 1 and (n, k) in _t else original(n, k, m, dev)
        try:
            forward()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
            graphs[name] = graph
        except Exception as e:      # a tile that does not compile or fit: named, not fatal
            print(json.dumps({"variant": name, "skipped": repr(e)[-300:]}), flush=True)
    w4_gemm.gemv_tile = original
    times = {name: [] for name in graphs}
    for _ in range(args.rounds):
        for name, graph in graphs.items():
            times[name].append(replay_ms(graph))
    rows = [{"variant": name, "graph_replay_ms": sorted(t)[len(t) // 2], "all_ms": t} for name, t in times.items()]
    base = min(r["graph_replay_ms"] for r in rows if r["variant"].startswith("shipped"))
    lines = [f"# W4 GEMV tiles in the batch-1 decode graph: {args.model} AWQ g128", "",
             f"shipped tiles: {', '.join(f'{n}x{k} {shipped[(n, k)]}' for n, k in shapes)}", "",
             "| variant (one product's tile at one row) | graph replay ms (median) | vs shipped |", "|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["graph_replay_ms"]):
        lines.append(f"| {r['variant']} | {r['graph_replay_ms']:.4f} | {r['graph_replay_ms'] - base:+.4f} |")
    lines += ["", f"commit {os.environ.get('TOKENMILL_GIT_COMMIT', 'unknown')}, {torch.cuda.get_device_name()}, "
              f"{args.rounds} turns"]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, f"w4_decode_tiles-{args.model}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, f"w4_decode_tiles-{args.model}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=5)
    main(p.parse_args())
