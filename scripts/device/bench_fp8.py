"""FP8 weights against bf16 on one GPU (scripts/device/bench_fp8.sh runs it).

  run [--model M] --quantization {none,fp8} --out DIR   one engine (M: preset:qwen3-4b unless given): batch-1 decode ms/token (one request, 32 in / 256
                                            out, the mean time between output tokens) and, unless
                                            --decode-only, the default offline workload (256 requests,
                                            100-1024 in / 100-1024 out, seed 0, ignore_eos) output tok/s;
                                            DIR/fp8_<q>.json
  summary --out DIR                         the table, printed and saved as DIR/SUMMARY-fp8.md
"""
from __future__ import annotations

import argparse
import json
import os
import time

MODEL = "preset:qwen3-4b"


def default_workload(llm, hf: dict):
    """The default offline workload on `llm` (256 requests, 100-1,024 tokens in and out, seed 0, greedy,
    eos ignored; `hf` the model's config.json): (seconds, output tokens, the outputs)."""
    import torch
    from tokenmill import SamplingParams
    from tokenmill.bench.datasets import random_requests, special_token_ids
    requests = random_requests(256, (100, 1024), (100, 1024), hf["vocab_size"], special_token_ids(hf), 0)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), outs


def run(args) -> None:
    import torch
    from tokenmill import LLM, SamplingParams
    from tokenmill.models.presets import resolve_model_path

    path = resolve_model_path(args.model)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    quant = None if args.quantization == "none" else args.quantization
    t0 = time.perf_counter()
    extra, label = {}, args.quantization
    if args.fp8_tiles:
        # the products' sweep's fastest tiles (fp8_products.py), as a KernelConfig's fp8_tiles
        from tokenmill.layers import kernel_config as kc
        with open(args.fp8_tiles) as f:
            tiles = {tuple(shape): eval(tile, vars(kc)) for shape, tile in json.load(f)}
        extra, label = dict(kernels=kc.KernelConfig(fp8_tiles=tiles)), "fp8-swept"
        print("fp8 tiles:", tiles)
    llm = LLM(path, quantization=quant, **extra)
    load_s = time.perf_counter() - t0
    model = llm.engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    llm.generate([[1] * 16, [2] * 24], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    one = llm.generate([[(17 * i + 5) % 50000 + 100 for i in range(32)]],
                       SamplingParams(temperature=0, max_tokens=256, ignore_eos=True), use_tqdm=False)[0]
    m = one.metrics
    decode_ms = 1e3 * (m.last_token_time - m.first_token_time) / (len(one.outputs[0].token_ids) - 1)

    offline = dict(offline_elapsed_s=None, offline_output_tok_s=None, offline_first_tokens=None)
    if not args.decode_only:
        elapsed, out_tokens, outs = default_workload(llm, hf)
        offline = dict(offline_elapsed_s=elapsed, offline_output_tok_s=out_tokens / elapsed,
                       offline_first_tokens=[o.outputs[0].token_ids[:8] for o in outs[:4]])
    result = dict(quantization=label, model=args.model, load_s=load_s, weight_gib=weight_bytes / 2**30,
                  kv_blocks=llm.engine.runner.num_blocks, decode_ms_per_token=decode_ms, **offline,
                  commit=os.environ.get("TOKENMILL_GIT_COMMIT", "unknown"), gpu=torch.cuda.get_device_name())
    with open(os.path.join(args.out, f"fp8_{label}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "offline_first_tokens"}))


def summary(args) -> None:
    rows = {}
    for q in ("none", "fp8", "fp8-swept"):
        p = os.path.join(args.out, f"fp8_{q}.json")
        if os.path.isfile(p):
            with open(p) as f:
                rows[q] = json.load(f)
    model = next(iter(rows.values()))["model"] if rows else MODEL
    lines = [f"## FP8 weights vs bf16, {model}", "",
             "| weights | weights GiB | KV blocks | load s | batch-1 decode ms/token | offline output tok/s | vs bf16 |",
             "|---|---|---|---|---|---|---|"]
    base = rows.get("none", {}).get("offline_output_tok_s")
    for q, r in rows.items():
        ratio = f"{r['offline_output_tok_s'] / base:.3f}x" if base else "-"
        name = {"none": "bf16", "fp8": "fp8 (at load, per channel)", "fp8-swept": "fp8, the sweep's tiles"}[q]
        lines.append(f"| {name} | {r['weight_gib']:.2f} | "
                     f"{r['kv_blocks']} | {r['load_s']:.1f} | {r['decode_ms_per_token']:.3f} | "
                     f"{r['offline_output_tok_s']:.0f} | {ratio} |")
    lines += ["", "targets: fp8 batch-1 decode <= 1.4 ms/token (bf16 2.31 measured before); offline >= 1.25x bf16",
              "decode: one request, 32 in / 256 out, mean time between output tokens; offline: 256 requests, "
              "100-1024 in / 100-1024 out, seed 0, ignore_eos"]
    if {"none", "fp8"} <= rows.keys():
        lines.append(f"GPU {rows['fp8']['gpu']}, commit {rows['fp8']['commit']}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "SUMMARY-fp8.md"), "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["run", "summary"])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--quantization", default="none", choices=["none", "fp8"])
    p.add_argument("--fp8-tiles", help="fp8_best_tiles.json of fp8_products.py: run FP8 with those tiles")
    p.add_argument("--out", required=True)
    p.add_argument("--decode-only", action="store_true", help="run: batch-1 decode only, not the offline workload")
    a = p.parse_args()
    run(a) if a.mode == "run" else summary(a)
