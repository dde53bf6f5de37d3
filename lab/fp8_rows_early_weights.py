"""`_fp8_rows_kernel` reading its first four weight steps before its programmatic-dependent-launch wait
(`Fp8RowsTile.early_steps`, per-channel products of at most `fp8_gemm.EARLY_ROWS` input rows), against the
same kernel reading nothing before the wait, in the engine's own CUDA graphs; or any other choice of
`fp8_gemm`'s module constants (`--variants`: `TENSORWISE_MAX_ROWS`, the rows up to which o_proj and down take cuBLASLt).

    python lab/fp8_rows_early_weights.py --out DIR [--model preset:qwen3-4b] [--batches 4,8,16,32,64] \
        [--early-rows 0,32,64 | --variants 'shipped;TENSORWISE_MAX_ROWS=0;EARLY_ROWS=0,TENSORWISE_MAX_ROWS=0'] \
        [--mixed-tokens 128,256,384]

The engine (FP8 weights and KV cache) decodes each batch for --steps steps (contexts of ~160 positions), then
its decode graph, and the mixed graphs of --mixed-tokens tokens (128) over as many sequences, are captured again under each
variant (`EARLY_ROWS` 0: no product reads early; `shipped`: the constants as they are) on the same static
buffers and timed, the variants in turns; the logits of each are compared with the first variant's.
DIR/fp8_rows_early_weights.{json,md}.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys

import torch

from tokenmill.layers.kernels import fp8_gemm


def parse_variant(spec: str) -> dict:
    """'shipped' -> {}; 'EARLY_ROWS=0,ROWS_MAX=128' -> {'EARLY_ROWS': 0, 'ROWS_MAX': 128}:
    `fp8_gemm` constants and the values they take in the variant."""
    if spec == "shipped":
        return {}
    patch = {}
    for item in re.split(r",(?=[A-Z_]+=)", spec.replace(" ", "")):
        name, value = item.split("=", 1)
        if not hasattr(fp8_gemm, name):
            raise SystemExit(f"fp8_gemm has no constant {name}")
        patch[name] = ast.literal_eval(value)
    return patch


def time_variants(gr, key: tuple, variants: list[str], turns: int) -> list[dict]:
    """The graph of `key` captured again under each of `variants` (`parse_variant`) on the runner's static
    buffers, then timed in `turns` turns (each a `replay_ms` of every variant in order): one row a variant."""
    from profile_decode import replay_ms
    graphs, logits = {}, {}
    for variant in variants:
        patch = parse_variant(variant)
        shipped = {name: getattr(fp8_gemm, name) for name in patch}
        for name, value in patch.items():
            setattr(fp8_gemm, name, value)
        try:
            forward = gr.static_forward(key)
            forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = forward()
            graph.replay()
            torch.cuda.synchronize()
            graphs[variant], logits[variant] = graph, out[1].float().clone()
        finally:
            for name, value in shipped.items():
                setattr(fp8_gemm, name, value)
    times = {v: [] for v in variants}
    for _ in range(turns):
        for v, graph in graphs.items():
            times[v].append(replay_ms(graph))
    first = variants[0]
    base = sorted(times[first])[turns // 2]
    rows = []
    for v in variants:
        ms = sorted(times[v])[turns // 2]
        row = dict(key=list(key), variant=v, ms=ms, ratio=ms / base, turns=times[v],
                   logits_max_diff=(logits[v] - logits[first]).abs().max().item(),
                   argmax_equal=(logits[v].argmax(-1) == logits[first].argmax(-1)).float().mean().item())
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="preset:qwen3-4b")
    ap.add_argument("--batches", default="4,8,16,32,64")
    ap.add_argument("--early-rows", default="0,32,64", help="EARLY_ROWS variants, comma-separated")
    ap.add_argument("--variants", help="';'-separated variants: 'shipped' or NAME=value[,NAME=value] of fp8_gemm's "
                    "constants (overrides --early-rows)")
    ap.add_argument("--mixed-tokens", default="128", help="token counts of the mixed graphs timed, comma-separated")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from tokenmill import LLM, SamplingParams
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "device"))

    os.makedirs(args.out, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    variants = (args.variants.split(";") if args.variants
                else [f"EARLY_ROWS={int(v)}" for v in args.early_rows.split(",")])
    for v in variants:
        parse_variant(v)
    mixed_tokens = [int(t) for t in args.mixed_tokens.split(",")]
    # graphs up to the largest mixed step timed here, so that the engine starts sooner
    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=max(batches), max_model_len=4096,
              cuda_graph_max_tokens=max(mixed_tokens),
              gpu_memory_utilization=0.5, quantization="fp8", kv_cache_dtype="fp8")
    gr = llm.engine.runner.graph_runner
    rows = []
    for bs in batches:
        prompts = [[100 + i + j for j in range(32)] for i in range(bs)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True))
        for key in [("decode", bs)] + [("mixed", t, bs) for t in mixed_tokens]:
            if key in gr.graphs:
                rows += time_variants(gr, key, variants, args.turns)
    with open(os.path.join(args.out, "fp8_rows_early_weights.json"), "w") as f:
        json.dump(dict(model=args.model, commit=os.environ.get("TOKENMILL_GIT_COMMIT"),
                       device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    lines = ["| graph | variant | ms | ratio | logits max diff | argmax equal |", "|---|---|---|---|---|---|"]
    lines += [f"| {' '.join(map(str, r['key']))} | {r['variant']} | {r['ms']:.4f} | {r['ratio']:.4f} | "
              f"{r['logits_max_diff']:.3g} | {r['argmax_equal']:.3f} |" for r in rows]
    with open(os.path.join(args.out, "fp8_rows_early_weights.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
