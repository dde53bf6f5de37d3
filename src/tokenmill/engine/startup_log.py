"""What the engine says once it is ready, as `vllm serve` does: the model, where and how it runs, how
much memory its weights and KV cache take, how many requests of full length fit at once, the CUDA
graphs, and how long the start took.

The engine core runs in a process of its own that inherits no logging configuration; the server
passes its log level in `EngineConfig.extra["log_level"]`, and the engine's process is configured
here with the server's format when nothing configured it before (offline use is left alone).
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("tokenmill.engine")

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def configure_process_logging(level: str | None) -> None:
    """Gives this process the server's logging, unless it has a configuration of its own."""
    if level is not None and not logging.getLogger().handlers:
        logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 0.1 * 2**30 else f"{n / 2**20:.1f} MiB"


def startup_lines(engine) -> list[str]:
    runner, mc, cfg = engine.runner, engine.model_config, engine.config
    device = str(runner.device)
    if runner.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(runner.device)})"
    params = {p.data_ptr(): p for p in runner.model.parameters()}.values()      # tied weights once
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    num_params = sum(p.numel() for p in params)
    blocks_per_request = -(-engine.max_model_len // cfg.block_size)
    kv_tokens = runner.num_blocks * cfg.block_size
    if runner.graphs:
        graphs = f"CUDA graphs: captured {runner.graph_summary}"
    elif runner.device.type != "cuda":
        graphs = f"CUDA graphs: off (device {runner.device.type})"
    else:
        graphs = "CUDA graphs: off (--enforce-eager)"
    preemption = engine.scheduler.preemption_mode
    if cfg.tensor_parallel_size > 1:    # the weights and KV cache below are rank 0's slice
        device += f", tensor_parallel_size {cfg.tensor_parallel_size} (each rank's share below)"
    if runner.swap_space is not None:
        preemption += (f" (swap space {format_bytes(runner.num_cpu_blocks * runner.block_bytes)}, "
                       f"{runner.num_cpu_blocks:,} blocks{', pinned' if runner.swap_space.cuda else ''})")
    return [
        f"model {engine.model_name}: {mc.architecture}, dtype {str(runner.dtype).replace('torch.', '')}, "
        f"device {device}, max_model_len {engine.max_model_len}",
        f"weights: {format_bytes(weight_bytes)} ({num_params / 1e6:.1f}M parameters), "
        f"loaded in {runner.load_seconds:.1f} s",
        f"KV cache: {runner.num_blocks} blocks of {cfg.block_size} tokens in "
        f"{str(runner.kv_cache_dtype).replace('torch.', '')}, {format_bytes(runner.kv_cache_bytes)}, "
        f"{kv_tokens:,} tokens; maximum concurrency for {engine.max_model_len:,} tokens per request: "
        f"{runner.num_blocks / blocks_per_request:.2f}x",
        graphs,
        f"scheduler: max_num_seqs {cfg.max_num_seqs}, max_num_batched_tokens {cfg.max_num_batched_tokens}, "
        f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'}, policy {cfg.scheduling_policy}, "
        f"preemption {preemption}",
        f"engine ready in {engine.ready_seconds:.1f} s",
    ]


def log_startup(engine) -> None:
    configure_process_logging(engine.config.extra.get("log_level"))
    for line in startup_lines(engine):
        logger.info(line)
