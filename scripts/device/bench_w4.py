"""W4A16 kernels on the GPU machine: per-product microbenchmark, then batch-1 decode bf16 vs AWQ 4-bit.

micro: each qwen3-4b linear shape at M = 1, 4, 8, 16, 256: the bf16 product the engine runs (the
single-token GEMV at M = 1, cuBLAS above) against `w4_gemm.w4_linear` (the W4 GEMV up to 4 rows,
dequantize + cuBLAS above), at up to 4 rows with its shipped tile and the best of a few other tiles
(so a better table can be shipped), each checked against the dequantized reference before it is
timed; at M = 256 also `w4_gemm.dequantize` alone against a copy of the bf16 weight. Times are CUDA-graph replays of 20 calls over enough weight copies that
the weights come from HBM, not L2. GB/s counts the weight bytes read (4-bit: words, scales, zeros).
"dequant+cuBLAS >=" is cuBLAS bf16 plus writing the bf16 weight at copy speed: the least the
dequantize-then-cuBLAS path can cost.

decode: `preset:qwen3-4b` (or each preset of --models / W4_MODELS) bf16, and the same weights quantized to
AWQ 4-bit group 128 by `quant/quantize.py` (on the GPU) into /tmp; batch-1 ms per token of `LLM.generate`
(32 tokens in, 128 out, ignore_eos) and the decode graph's replay time. A third row runs the AWQ model
with its layers' RMSNorms and SiLU-and-mul skipped (the rows pass through unchanged; its tokens are
meaningless): the most that folding them into the 4-bit products, as the 16-bit and FP8 single-token
products fold them, could save.

Usage: python scripts/device/bench_w4.py {micro,decode} --out DIR   (results: DIR/w4_<stage>.json)
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import shutil
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "kernels"))

SHAPES = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
if os.environ.get("W4_SHAPES") == "all":       # nanbeige4.1-3b's products too
    SHAPES.update({"nb qkv": (3584, 2560), "nb o_proj": (2560, 2560), "nb gate_up": (20992, 2560),
                   "nb down": (2560, 10496)})
ROWS = tuple(int(m) for m in os.environ.get("W4_ROWS", "1,4,8,16,256").split(","))   # the last: the dequantize row
CALLS = 20


def graph_us(fns, calls: int = CALLS) -> float:
    """Device time of one call: a CUDA graph of `calls` calls cycling through `fns`, replayed 5 times."""
    for f in fns[:2]:
        f()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fns[0]()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * calls)


def micro(out_dir: str) -> list[dict]:
    from kernel_testing import DEVICE, HALF        # cuda and bfloat16 on the GPU machine
    from test_w4_kernels import _layer, _reference
    from tokenmill.layers.kernels import gemv, w4_gemm
    gen = torch.Generator().manual_seed(0)
    gemv_tiles = [w4_gemm.W4GemvTile(*t) for t in ((4, 128, 1), (8, 128, 1), (16, 128, 1), (4, 256, 2),
                                                   (8, 256, 2), (16, 256, 2), (8, 512, 4), (4, 512, 4),
                                                   (16, 512, 4), (8, 1024, 8), (4, 1024, 8))]
    rows = []
    for name, (n, k) in SHAPES.items():
        (qweight, scales, zeros), _ = _layer("awq", n, k, 128, 1)
        w4_bytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel()
        copies = max(1, -(-160 * 2 ** 20 // w4_bytes))
        w4s = [(qweight.clone(), scales.clone(), zeros.clone()) for _ in range(copies)]
        wb = (torch.randn(n, k, generator=gen) * 0.02).to(HALF).to(DEVICE)
        bf16s = [wb.clone() for _ in range(max(1, -(-160 * 2 ** 20 // (2 * n * k))))]
        copy_dst = torch.empty_like(wb)
        copy_us = graph_us([lambda: copy_dst.copy_(wb)])
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).to(HALF).to(DEVICE)
            ref = _reference(x, qweight, scales, zeros, None, 128, m > w4_gemm.GEMV_ROWS)
            tol = 2e-2 * ref.abs().max().item()
            if m == 1:
                bf16_us = graph_us([lambda w=w: gemv.fused_linear(x, w) for w in bf16s])
            else:
                bf16_us = graph_us([lambda w=w: F.linear(x, w) for w in bf16s])
            tiles = gemv_tiles if m <= w4_gemm.GEMV_ROWS else []
            results = {}
            for tile in [None, *tiles]:
                try:
                    y = w4_gemm.w4_linear(x, qweight, scales, zeros, None, 128, tile=tile)
                    err = (y.float() - ref).abs().max().item()
                    if not err <= tol:
                        results[str(tile)] = f"WRONG (max error {err:.3g} > {tol:.3g})"
                        continue
                    results[str(tile)] = graph_us([lambda t=t: w4_gemm.w4_linear(x, *t, None, 128, tile=tile)
                                                   for t in w4s])
                except Exception as e:         # a tile that does not compile or fit: named, not fatal
                    results[str(tile)] = f"ERROR {type(e).__name__}: {str(e)[:120]}"
            timed = {t: v for t, v in results.items() if isinstance(v, float)}
            best = min(timed, key=timed.get) if timed else None
            row = dict(shape=name, n=n, k=k, m=m, bf16_us=bf16_us, bf16_gbs=2 * n * k / bf16_us / 1e3,
                       w4_us=results["None"], best_tile=best, best_us=timed.get(best),
                       dequant_cublas_us_min=bf16_us + copy_us if m > 1 else None,
                       w4_gbs=w4_bytes / results["None"] / 1e3 if isinstance(results["None"], float) else None,
                       tiles=results)
            if m == ROWS[-1]:          # the dequantize alone, against the copy of the same bf16 bytes
                row["dequant_us"] = graph_us([lambda t=t: w4_gemm.dequantize(*t, 128, HALF) for t in w4s])
                row["copy_us"] = copy_us
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tiles"}), flush=True)
        del w4s, bf16s
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "w4_micro.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def quantize_preset(src: str, dst: str) -> None:
    """The preset's weights quantized to AWQ group 128 on the GPU, written as an AWQ checkpoint."""
    from safetensors.torch import load_file, save_file
    from tokenmill.quant.quantize import quantization_config, quantize_state_dict
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if os.path.isfile(os.path.join(dst, "config.json")):
        return
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    state = {}
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        state.update(load_file(path, device=device))
    with torch.device(device):          # the quantizer's index tensors on the weights' device
        q = quantize_state_dict(state, "awq", 128)
    save_file({k: v.cpu() for k, v in q.items()}, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    del state, q
    for path in glob.glob(os.path.join(src, "*")):
        base = os.path.basename(path)
        if not base.endswith(".safetensors") and base != "model.safetensors.index.json" and os.path.isfile(path):
            shutil.copy(path, tmp)
    with open(os.path.join(tmp, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization_config("awq", 128)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    os.rename(tmp, dst)


def decode_ms(model: str, label: str) -> dict:
    from tokenmill import LLM, SamplingParams
    from profile_decode import graph_replay_ms
    t0 = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", max_num_seqs=8, max_model_len=1024, gpu_memory_utilization=0.35)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    prompt = [100 + j for j in range(32)]
    llm.generate([prompt], params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)
    wall = time.perf_counter() - t0
    assert len(out[0].outputs[0].token_ids) == 128
    runner = llm.engine.runner
    row = dict(model=label, ms_per_token=1e3 * wall / 128, graph_replay_ms=graph_replay_ms(runner, 1),
               load_s=load_s, tokens=out[0].outputs[0].token_ids[:8])
    print(json.dumps(row), flush=True)
    del llm, runner, out
    gc.collect()
    torch.cuda.empty_cache()
    return row


def layer_norms_skipped():
    """The Triton backend with the decoder layers' RMSNorms (those feeding a product) returning their input
    rows, and SiLU-and-mul returning the gate half: the layers' own kernels gone, every product as it was."""
    from unittest import mock
    from tokenmill.layers.backend import TritonBackend
    norm = TritonBackend.rms_norm

    def rms_norm(self, x, weight, eps, residual=None, into=None):
        if into is None:                   # the model's last norm, before the head
            return norm(self, x, weight, eps, residual)
        return x if residual is None else (x, residual)

    def act_and_mul(self, x, act, into=None):
        return x[..., : x.shape[-1] // 2]
    return mock.patch.multiple(TritonBackend, rms_norm=rms_norm, act_and_mul=act_and_mul)


def awq_preset(model: str) -> tuple[str, str]:
    """(the bf16 preset's path, its AWQ g128 checkpoint's), the latter quantized into /tmp unless there."""
    from tokenmill.models.presets import resolve_model_path
    bf16 = resolve_model_path(f"preset:{model}", "bfloat16", 0)
    awq = f"/tmp/tokenmill-w4/{model}-awq-g128"
    quantize_preset(bf16, awq)
    return bf16, awq


def decode(out_dir: str, models: list[str]) -> list[dict]:
    sys.path.insert(0, os.path.dirname(__file__))
    rows = []
    for model in models:
        t0 = time.perf_counter()
        bf16, awq = awq_preset(model)
        print(json.dumps({"model": model, "prepare_s": time.perf_counter() - t0}), flush=True)   # preset and AWQ copy
        rows += [decode_ms(bf16, f"{model} bf16"), decode_ms(awq, f"{model} awq g128")]
        with layer_norms_skipped():
            rows.append(decode_ms(awq, f"{model} awq g128, layer norms and SiLU-and-mul skipped (bound)"))
    with open(os.path.join(out_dir, "w4_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def summary(out_dir: str) -> str:
    lines = ["# W4A16 kernels (qwen3-4b shapes, AWQ group 128, bf16 activations)", ""]
    path = os.path.join(out_dir, "w4_micro.json")
    if os.path.isfile(path):
        lines += ["| product | N x K | M | bf16 us | bf16 GB/s | W4 us | W4 GB/s | best tile | best us | "
                  "dequant+cuBLAS >= us |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in json.load(open(path)):
            w4 = r["w4_us"]
            fmt = (lambda v: f"{v:.1f}" if isinstance(v, float) else str(v))
            lines.append(f"| {r['shape']} | {r['n']}x{r['k']} | {r['m']} | {r['bf16_us']:.1f} | {r['bf16_gbs']:.0f} | "
                         f"{fmt(w4)} | {fmt(r['w4_gbs']) if r['w4_gbs'] else '-'} | {r['best_tile']} | "
                         f"{fmt(r['best_us'])} | {fmt(r['dequant_cublas_us_min']) if r['dequant_cublas_us_min'] else '-'} |")
        bad = [(r["shape"], r["m"], t, v) for r in json.load(open(path)) for t, v in r["tiles"].items()
               if isinstance(v, str) and v.startswith("WRONG")]
        lines += ["", f"wrong results: {bad if bad else 'none'}", ""]
        deq = [r for r in json.load(open(path)) if "dequant_us" in r]
        if deq:
            lines += ["| product | dequantize us | bf16 copy us | dequantize / copy |", "|---|---|---|---|"]
            lines += [f"| {r['shape']} | {r['dequant_us']:.1f} | {r['copy_us']:.1f} | {r['dequant_us'] / r['copy_us']:.2f} |"
                      for r in deq]
            lines.append("")
    path = os.path.join(out_dir, "w4_decode.json")
    if os.path.isfile(path):
        lines += ["| model | batch-1 ms/token | graph replay ms | load s |", "|---|---|---|---|"]
        for r in json.load(open(path)):
            lines.append(f"| {r['model']} | {r['ms_per_token']:.3f} | {r['graph_replay_ms']:.3f} | {r['load_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=("micro", "decode", "summary"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default=os.environ.get("W4_MODELS", "qwen3-4b"),
                    help="decode: the presets, comma-separated (qwen3-4b,nanbeige4.1-3b)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.stage == "micro":
        micro(args.out)
    elif args.stage == "decode":
        decode(args.out, args.models.split(","))
    else:
        text = summary(args.out)
        with open(os.path.join(args.out, "SUMMARY-w4.md"), "w") as f:
            f.write(text + "\n")
        print(text)


if __name__ == "__main__":
    main()
