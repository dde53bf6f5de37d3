"""`tokenmill bench memory`'s run: each model studied (memory.py) in a process of its own, or in this one; one
JSON, markdown and plot for all of them (memory_report.py)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

from tokenmill.bench.child_process import child_env, materialise
from tokenmill.bench.datasets import parse_range
from tokenmill.bench.provenance import git_commit

MEMORY_MODELS = ("preset:qwen3-4b", "preset:nanbeige4.1-3b")


def _memory_workloads(args):
    from tokenmill.bench.memory import make_workloads

    return make_workloads((args.num_concurrent, parse_range(args.concurrent_len_range)),
                          (args.num_mixed, parse_range(args.mixed_len_range)), (args.num_long, args.long_len),
                          args.output_len, args.seed)


def run_memory(args, argv: list[str]) -> int:
    """`bench memory`: each model studied in a process of its own (its engines' GPU memory never mixes with
    another model's, and its KV-budget engine profiles a fresh device), or in this one with --in-process
    or --compute-only; one JSON, markdown and plot for all of them."""
    from tokenmill.bench.memory import study_model
    from tokenmill.bench.memory_report import concurrency_table, memory_table, write_outputs
    from tokenmill.models.presets import is_preset

    if args.replot:
        with open(args.replot) as f:
            summary = json.load(f)
        write_outputs(summary, args.output_dir, args.name or os.path.basename(args.replot).removesuffix(".json"))
        print(memory_table(summary) + "\n\n" + concurrency_table(summary))
        return 0
    workloads = _memory_workloads(args)
    if args.worker_result:
        result = study_model(args.worker_model, args.worker_model_path, workloads, args)
        with open(args.worker_result, "w") as f:
            json.dump(result, f)
        return 0
    models = [m.strip() for arg in (args.model or [",".join(MEMORY_MODELS)]) for m in arg.split(",") if m.strip()]
    name = args.name or f"memory-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    os.makedirs(args.output_dir, exist_ok=True)
    results = []
    for model in models:
        print(f"== {model}", file=sys.stderr, flush=True)
        if args.compute_only:
            results.append(study_model(model, None if is_preset(model) else model, workloads, args))
            continue
        path = materialise(argparse.Namespace(**{**vars(args), "model": model}))
        if args.in_process:
            results.append(study_model(model, path, workloads, args))
            continue
        slug = model.replace("preset:", "").rstrip("/").split("/")[-1]
        result_file = os.path.join(args.output_dir, f"{name}.{slug}.json")
        cmd = [sys.executable, "-m", "tokenmill.bench", *argv, "--worker-model", model,
               "--worker-model-path", path, "--worker-result", result_file]
        proc = subprocess.run(cmd, env=child_env())
        if proc.returncode != 0 or not os.path.isfile(result_file):
            results.append({"model": model, "error": f"exit status {proc.returncode}"})
            continue
        with open(result_file) as f:
            results.append(json.load(f))
    measured = [r["device_budget"]["hardware"] for r in results if "device_budget" in r]
    summary = {
        "command": "tokenmill bench " + " ".join(argv),
        "git_commit": git_commit(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hardware": measured[0] if measured else "none (computed, no engine run)",
        "settings": {k: getattr(args, k) for k in (
            "block_size", "max_model_len", "output_len", "seed", "dtype", "max_num_seqs",
            "max_num_batched_tokens", "gpu_memory_utilization", "gpu_gib", "overhead_gib", "compute_only")},
        "workloads": [{"name": w.name, "description": w.description, "lengths": list(w.lengths),
                       "output_len": w.output_len} for w in workloads],
        "models": results,
    }
    write_outputs(summary, args.output_dir, name)
    print(memory_table(summary) + "\n\n" + concurrency_table(summary))
    print(f"results: {os.path.join(args.output_dir, name)}.{{json,md,png}}", file=sys.stderr)
    return 1 if any("error" in r for r in results) else 0
