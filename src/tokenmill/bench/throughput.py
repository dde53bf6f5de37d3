"""Offline throughput of one backend on one request set, measured in this process.

Time to ready runs from `start_time` (the parent's clock just before it spawned this process, or the call
of `run_backend` when run in-process) until the model is loaded and a small warm-up generation has finished,
CUDA-graph capture included. The timed run is one call that submits every request at once and returns when
all are done; every request produces exactly its requested number of output tokens (eos ignored).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tokenmill.bench import BACKENDS
from tokenmill.bench.datasets import BenchRequest
from tokenmill.config import ModelConfig, parse_dtype


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """The same rule as the engine's: 'auto' is the checkpoint's dtype on a GPU and float32 on the CPU."""
    if dtype != "auto":
        return parse_dtype(dtype)
    if device.type == "cpu":
        return torch.float32
    return model_config.dtype if model_config.dtype != torch.float32 else torch.bfloat16


def hardware_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _run_tokenmill(args, model_path: str, requests: list[BenchRequest], mark_ready) -> tuple[list[list[int]], dict]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=model_path, dtype=args.dtype, device=args.device, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=not args.no_prefix_caching, max_model_len=args.max_model_len,
              num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
              seed=args.seed, enforce_eager=args.enforce_eager, cuda_graph_max_tokens=args.cuda_graph_max_tokens,
              swap_space=args.swap_space,
              preemption_mode=args.preemption_mode, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([[1] * 16, [2] * 24], warm, use_tqdm=False)
    mark_ready()
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=r.output_len, ignore_eos=True,
                             seed=args.seed + i if args.temperature > 0 else None)
              for i, r in enumerate(requests)]
    t0 = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - t0
    stats = llm.engine.get_stats()
    extra: dict[str, Any] = {"elapsed_s": elapsed}
    for key in ("peak_blocks_used", "num_total_blocks", "num_preemptions", "prefix_cache_hits",
                "swapped_out_blocks", "swapped_in_blocks", "swap_in_cached_blocks", "swap_out_bytes",
                "num_cpu_blocks"):
        if key in stats:
            extra[key] = stats[key]
    extra["block_size"] = args.block_size
    extra["kv_cache_dtype"] = args.kv_cache_dtype
    extra["quantization"] = args.quantization
    tpots = []
    for out in outputs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        if m is not None and m.first_token_time is not None and m.last_token_time is not None and n > 1:
            tpots.append((m.last_token_time - m.first_token_time) / (n - 1))
    if tpots:
        extra["mean_tpot_ms"] = 1e3 * sum(tpots) / len(tpots)
    # every request is submitted at t0: its latency is the time to its last token
    e2e = [m.last_token_time - m.arrival_time for m in (o.metrics for o in outputs)
           if m is not None and m.last_token_time is not None]
    if e2e:      # numpy's linear percentiles, as `bench serve` and vLLM's take them
        extra["p50_latency_s"], extra["p99_latency_s"] = (float(v) for v in np.percentile(e2e, [50, 99]))
    return [list(o.outputs[0].token_ids) for o in outputs], extra


def _run_hf(args, backend: str, model_path: str, requests: list[BenchRequest], mark_ready, device, dtype):
    from tokenmill.bench import hf_backends

    if backend == "hf-static":
        runner = hf_backends.HFStatic(model_path, dtype, device, batch_size=args.hf_batch_size,
                                      attn_implementation=args.hf_static_attn_impl)
        extra = {"hf_batch_size": args.hf_batch_size}
    else:
        runner = hf_backends.HFContinuousBatching(
            model_path, dtype, device, max_memory_percent=args.hf_max_memory_percent,
            attn_implementation=args.hf_cb_attn_impl, workload=requests)
        extra = {"hf_max_memory_percent": args.hf_max_memory_percent,
                 "hf_attn_implementation": runner.attn_implementation}
    runner.warmup()
    mark_ready()
    with tqdm(total=len(requests), desc=backend, unit="req", disable=args.no_progress) as bar:
        t0 = time.perf_counter()
        token_ids = runner.generate(requests, progress=bar.update)
        extra["elapsed_s"] = time.perf_counter() - t0
    if hasattr(runner, "close"):
        runner.close()
    return token_ids, extra


def run_backend(backend: str, args, model_path: str, requests: list[BenchRequest],
                start_time: float | None = None) -> dict[str, Any]:
    """Loads `backend`, warms it up, generates `requests`, and returns its metrics."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    start_time = time.time() if start_time is None else start_time
    import transformers

    model_config = ModelConfig.from_hf(model_path)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, model_config, device)
    ready: dict[str, float] = {}

    def mark_ready():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ready["t"] = time.time()

    if backend == "tokenmill":
        token_ids, extra = _run_tokenmill(args, model_path, requests, mark_ready)
    else:
        token_ids, extra = _run_hf(args, backend, model_path, requests, mark_ready, device, dtype)
    elapsed = extra.pop("elapsed_s")
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(min(len(ids), r.output_len) for ids, r in zip(token_ids, requests))
    result = {
        "backend": backend,
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requested_output_tokens": sum(r.output_len for r in requests),
        "num_short_outputs": sum(len(ids) < r.output_len for ids, r in zip(token_ids, requests)),
        "elapsed_s": elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
        "requests_s": len(requests) / elapsed,
        "ms_per_output_token": 1e3 * elapsed / output_tokens if len(requests) == 1 else None,
        "time_to_ready_s": ready["t"] - start_time,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "hardware": hardware_name(device),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        **extra,
    }
    if device.type == "cuda":
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result
