"""`tokenmill bench throughput`'s run: one request set through one or more backends, one process per backend.

    python -m tokenmill.bench throughput --model preset:qwen3-4b --backend tokenmill,hf-cb --subset 64

The parent builds the request set once and hands it to each backend's own process in turn (so their GPU
memory never mixes), then prints one table with the ratios between backends and writes JSON + markdown to
`--output-dir`.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

from tokenmill.bench import BACKENDS, report
from tokenmill.bench.child_process import child_env, materialise
from tokenmill.bench.datasets import (load_requests, parse_range, random_requests, save_requests,
                                      sharegpt_requests, special_token_ids)
from tokenmill.bench.provenance import git_commit


def _hf_config(model: str) -> dict:
    from tokenmill.models.presets import is_preset, preset_config

    if is_preset(model):
        return preset_config(model)
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)


def build_requests(args, hf_config: dict, model_path: str | None):
    if args.dataset == "random":
        return random_requests(args.num_prompts, parse_range(args.input_len_range),
                               parse_range(args.output_len_range), hf_config["vocab_size"],
                               special_token_ids(hf_config), args.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_path)
    try:
        return sharegpt_requests(args.dataset, tokenizer, args.num_prompts, args.seed, max_input_len=1024,
                                 max_output_len=1024)
    except ValueError as e:             # a dataset file that cannot be read
        raise SystemExit(str(e)) from None


def run_worker(args) -> int:
    from tokenmill.bench.throughput import run_backend

    requests = load_requests(args.worker_requests)
    result = run_backend(args.backend, args, args.worker_model_path, requests, start_time=args.spawn_time)
    with open(args.worker_result, "w") as f:
        json.dump(result, f)
    return 0


def _run_child(args, argv: list[str], backend: str, model_path: str, requests_file: str, result_file: str) -> dict:
    cmd = [sys.executable, "-m", "tokenmill.bench", *argv, "--backend", backend, "--worker-requests",
           requests_file, "--worker-result", result_file, "--worker-model-path", model_path,
           "--spawn-time", repr(time.time())]
    proc = subprocess.run(cmd, env=child_env())
    if proc.returncode != 0 or not os.path.isfile(result_file):
        return {"backend": backend, "error": f"exit status {proc.returncode}"}
    with open(result_file) as f:
        return json.load(f)


def _weight_format(quantization: str | None, checkpoint) -> tuple[str | None, int]:
    """The projections' format the engine serves (`--quantization`, else the checkpoint's, as
    `ModelConfig.quantization` parsed it) as the roofline takes it, and the 4-bit group size."""
    method = quantization or (checkpoint.method if checkpoint is not None else None)
    return method, getattr(checkpoint, "group_size", 128)


def run_throughput(args, argv: list[str]) -> dict:
    from tokenmill.bench.roofline import Hardware, ModelCost, decode_floor_ms_per_token, roofline_floor
    from tokenmill.config import ModelConfig

    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    model_path = materialise(args)
    hf_config = _hf_config(model_path)
    requests = build_requests(args, hf_config, model_path)
    if args.subset is not None:
        requests = requests[:args.subset]
    if not requests:
        raise SystemExit("the request set is empty")

    model_config = ModelConfig.from_hf(hf_config)
    dtype_bytes = 4 if args.dtype in ("float32", "fp32", "float") else 2
    weights, group = _weight_format(args.quantization, model_config.quantization)
    cost = ModelCost.from_model_config(model_config, dtype_bytes, weights, args.kv_cache_dtype, group)
    hw = Hardware(args.memory_bandwidth, args.matmul_flops)
    floor = roofline_floor([r.prompt_len for r in requests], [r.output_len for r in requests], cost,
                           args.max_num_seqs, args.max_num_batched_tokens, hw)

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = args.model.replace("preset:", "").rstrip("/").split("/")[-1]
    name = args.name or f"throughput-{slug}-{stamp}"
    os.makedirs(args.output_dir, exist_ok=True)
    requests_file = os.path.join(args.output_dir, f"{name}.requests.json")
    save_requests(requests, requests_file)

    results = []
    for backend in backends:
        print(f"== {backend}: {len(requests)} requests", file=sys.stderr, flush=True)
        if args.in_process:
            from tokenmill.bench.throughput import run_backend
            result = run_backend(backend, args, model_path, requests)
        else:
            result = _run_child(args, argv, backend, model_path, requests_file,
                                os.path.join(args.output_dir, f"{name}.{backend}.json"))
        if "elapsed_s" in result:
            result["floor_s"] = floor.seconds
            result["measured_over_floor"] = result["elapsed_s"] / floor.seconds
            result["fraction_of_floor"] = floor.seconds / result["elapsed_s"]
            if len(requests) == 1:
                r = requests[0]
                result["floor_ms_per_output_token"] = decode_floor_ms_per_token(
                    cost, r.prompt_len + r.output_len // 2, hw)
        results.append(result)
    report.add_ratios(results)

    summary = {
        "command": "tokenmill bench " + " ".join(argv),
        "git_commit": git_commit(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hardware": next((r["hardware"] for r in results if "hardware" in r), None),
        "model": args.model,
        "model_path": model_path,
        "workload": {
            "dataset": args.dataset, "num_requests": len(requests), "seed": args.seed,
            # the ranges drawn from; a dataset file's requests keep their own lengths
            **({"input_len_range": args.input_len_range, "output_len_range": args.output_len_range}
               if args.dataset == "random" else {}),
            "subset": args.subset, "prompt_tokens": floor.total_tokens - floor.output_tokens,
            "output_tokens": floor.output_tokens,
        },
        "engine_args": {k: getattr(args, k) for k in (
            "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "dtype", "block_size",
            "enforce_eager", "cuda_graph_max_tokens", "no_prefix_caching", "temperature", "top_p", "hf_batch_size", "hf_max_memory_percent")},
        "roofline": {"memory_bandwidth": hw.memory_bandwidth, "matmul_flops": hw.matmul_flops,
                     "weights": weights or args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                     "weight_bytes": cost.weight_bytes, "kv_bytes_per_token": cost.kv_bytes_per_token,
                     "matmul_rate": cost.matmul_rate,
                     **floor.as_dict()},
        "results": results,
    }
    table = report.markdown_table(summary)
    print(table)
    with open(os.path.join(args.output_dir, f"{name}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(args.output_dir, f"{name}.md"), "w") as f:
        f.write(report.markdown_report(summary, table))
    print(f"results: {os.path.join(args.output_dir, name)}.{{json,md}}", file=sys.stderr)
    return summary
