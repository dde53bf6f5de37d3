"""The engine's options (model format, memory, batching, scheduling, KV cache, CUDA graphs), shared by
`serve` and `generate`, and the `EngineConfig` built from them."""
from __future__ import annotations

import argparse

from tokenmill.cli.arg_types import context_len, json_object, step_tokens
from tokenmill.config import KV_CACHE_DTYPES, EngineConfig
from tokenmill.config_values import DTYPE_CHOICES
from tokenmill.quant.formats import QUANTIZATION_ALIASES, QUANTIZATION_METHODS


def add_engine_args(p: argparse.ArgumentParser):
    d = EngineConfig(model="")
    # read by `parse_with_config` before argparse sees the command line; here for --help
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML file of options, as vLLM's: option names as keys (port: 8001, "
                        "max_num_seqs: 64, enable_prefix_caching: false, model: DIR), under the command line's")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPE_CHOICES, metavar="DTYPE",
                   help="auto (the checkpoint's, float32 on the CPU), float32, float16 or bfloat16 (and vLLM's "
                        "spellings: float, half, fp16, bf16)")
    p.add_argument("--quantization", choices=[*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES], default=d.quantization,
                   help="the checkpoint's weight format (default: read from its config.json's "
                        "quantization_config; given, it must match); fp8 on a plain checkpoint or a GGUF file "
                        "quantizes its linear layers to FP8 E4M3 at load; vLLM's awq_marlin and gptq_marlin are awq and gptq")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="KV-cache element type: auto (the model dtype) or fp8 (E4M3, half the bytes per token)")
    p.add_argument("--device", default=d.device, help="auto, cuda, cuda:N or cpu")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of the GPU's memory for weights, activations and the KV cache")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=step_tokens, default=d.max_num_batched_tokens,
                   help="most tokens in one step; 8k = 8,000, 8K = 8,192")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="processes that split every layer (heads, MLP features, vocabulary) between them; "
                        "must divide the model's KV heads. CPU (gloo) only for now")
    p.add_argument("--max-model-len", type=context_len, default=d.max_model_len,
                   help="context length, prompt plus output (default: the model's); 32k = 32,000, 32K = 32,768")
    p.add_argument("--hf-overrides", type=json_object, default=d.hf_overrides, metavar="JSON",
                   help="a JSON object merged over the model's config.json before it is read (objects key by "
                        "key), as vLLM's: '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                        "\"original_max_position_embeddings\": 32768}}' serves Qwen3 at 131,072 tokens")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="reuse the KV blocks of equal prompt prefixes")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
                   help="order of the waiting requests")
    p.add_argument("--priority-aging-per-second", type=float, default=d.priority_aging_per_second,
                   help="priority policy: rank credit per second since arrival (> 0, so nothing starves)")
    p.add_argument("--priority-tool-boost", type=float, default=d.priority_tool_boost,
                   help="priority policy: rank credit of a request that carries tools")
    p.add_argument("--priority-short-boost", type=float, default=d.priority_short_boost,
                   help="priority policy: rank credit of a short request (see --priority-short-max-tokens)")
    p.add_argument("--priority-short-max-tokens", type=int, default=d.priority_short_max_tokens,
                   help="priority policy: a request asking for at most this many tokens is short")
    p.add_argument("--scheduler-delay-factor", type=float, default=d.scheduler_delay_factor,
                   help="while requests run, new prompts may wait this many times the last step's time to "
                        "gather into a bigger prefill (0: off)")
    p.add_argument("--target-itl-ms", type=float, default=d.target_itl_ms,
                   help="cap each step's tokens and sequences so that a step (the time between two tokens "
                        "of a request) stays under this many milliseconds, by a model of step time fitted "
                        "while serving (default: off)")
    p.add_argument("--swap-space", type=float, default=d.swap_space,
                   help="GiB of CPU memory (pinned on CUDA) holding the KV blocks of swapped-out requests")
    p.add_argument("--preemption-mode", choices=["swap", "recompute"], default=d.preemption_mode,
                   help="what a request preempted for lack of KV blocks does: swap its blocks to CPU memory "
                        "(recompute when the swap space is full) or recompute them later (default: swap "
                        "if --swap-space > 0, else recompute)")
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks,
                   help="KV-cache blocks (default: sized from --gpu-memory-utilization)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the engine's random state")
    p.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=d.cuda_graph_max_tokens,
                   help="largest step with prefill tokens run as a CUDA graph (0: decode graphs only)")


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy, num_kv_blocks=args.num_kv_blocks, seed=args.seed,
        enforce_eager=args.enforce_eager, cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        priority_aging_per_second=args.priority_aging_per_second, priority_tool_boost=args.priority_tool_boost,
        priority_short_boost=args.priority_short_boost, priority_short_max_tokens=args.priority_short_max_tokens,
        scheduler_delay_factor=args.scheduler_delay_factor, target_itl_ms=args.target_itl_ms,
        swap_space=args.swap_space, preemption_mode=args.preemption_mode,
        tensor_parallel_size=args.tensor_parallel_size, hf_overrides=args.hf_overrides)
