"""Frozen configs: `EngineConfig` (the engine's settings: the KV cache dtypes it takes, its checks, the device
and dtypes it resolves) and `priority_refusal`. `ModelConfig` (the model's shape and features) lives in
`model_config.py` and is imported from here, as the rest of the package does."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.config_values import parse_dtype
from tokenmill.layers.kernel_config import KernelConfig
from tokenmill.model_config import ModelConfig
from tokenmill.quant.formats import QUANTIZATION_ALIASES, QUANTIZATION_METHODS

# torch is imported where a dtype or a device is made, not here: an API server process builds these
# configs (the command line's) without the tensor library, which would cost it ~1.5 s of CPU and ~180 MB

if TYPE_CHECKING:
    import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    # the checkpoint's weight format, as vLLM's --quantization: None takes the checkpoint's
    # (quantization_config in config.json); "awq" / "gptq" / "fp8" must match it (vLLM's "awq_marlin" /
    # "gptq_marlin" are "awq" / "gptq"), and "fp8" on a plain
    # checkpoint quantizes its linear layers at load (quant/fp8.py)
    quantization: str | None = None
    # the KV cache's element type, as vLLM's --kv-cache-dtype: "auto" (the model dtype) or "fp8" (alias
    # "fp8_e4m3": E4M3 with per-layer scales, layers/attention.py)
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    scheduling_policy: str = "fcfs"
    # --scheduling-policy priority ranks by priority - boosts - aging x seconds since arrival (lower first)
    priority_aging_per_second: float = 1.0
    priority_tool_boost: float = 5.0
    priority_short_boost: float = 2.0
    priority_short_max_tokens: int = 100
    # new prompts may wait this many times the last step's time to join a bigger prefill (0: off)
    scheduler_delay_factor: float = 0.0
    # cap each step's shape so that its time stays under this many milliseconds (None: off)
    target_itl_ms: float | None = None
    # GiB of host memory for KV blocks of swapped-out requests (pinned when the KV cache is on CUDA)
    swap_space: float = 4.0
    # how a request gives up its blocks: "swap" (to the swap space, recompute when it is full) or
    # "recompute"; None: swap when swap_space > 0, else recompute
    preemption_mode: str | None = None
    seed: int = 0
    enforce_eager: bool = False
    # steps with prefill tokens run as CUDA graphs up to this many tokens (0: only decode graphs)
    cuda_graph_max_tokens: int = 2048
    tokenizer: str | None = None
    # merged over the checkpoint's config.json before it is read, as vLLM's --hf-overrides
    # (`merge_hf_overrides`), e.g. {"rope_scaling": {"rope_type": "yarn", ...}}
    hf_overrides: dict | None = None
    extra: dict = field(default_factory=dict)
    # tiles and block sizes of the CUDA kernels (layers/kernel_config.py); the default is the shipped table
    kernels: KernelConfig = field(default_factory=KernelConfig)
    # ranks (one process each) that split every layer, as vLLM's --tensor-parallel-size
    # (runner/tensor_parallel.py); 1: one process, no process group
    tensor_parallel_size: int = 1

    def __post_init__(self):
        if self.quantization is not None and self.quantization not in (*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES):
            raise ValueError(f"quantization {self.quantization!r} is not supported; supported: "
                             f"{', '.join(QUANTIZATION_METHODS)} (or None: the checkpoint's own; vLLM's "
                             f"{' and '.join(QUANTIZATION_ALIASES)} are awq and gptq)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; supported: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not isinstance(self.seed, int) or not -2 ** 63 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be a 64-bit integer (in [-2**63, 2**63)), got {self.seed}")
        if self.tokenizer is not None:
            from tokenmill.engine.tokenizer import Tokenizer
            if not os.path.exists(self.tokenizer) or not Tokenizer.available(self.tokenizer):
                raise ValueError(f"tokenizer {self.tokenizer!r} holds no tokenizer (tokenizer.json, "
                                 "tokenizer_config.json, vocab.json, tokenizer.model, or a .gguf with one)")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict merged over config.json (None: none), got "
                             f"{type(self.hf_overrides).__name__} {self.hf_overrides!r}")
        if self.hf_overrides and self.model.lower().endswith(".gguf"):
            raise ValueError(f"hf_overrides edit a checkpoint's config.json; the GGUF model {self.model!r} has none "
                             "(its config is its metadata)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (or None: the model's), got {self.max_model_len}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            # refused before anything loads (torch took "mps" or "meta" and failed in the core)
            raise ValueError(f"device {self.device!r} is not a device tokenmill runs on: auto, cpu, cuda or cuda:N")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if not 0.0 < self.priority_aging_per_second < math.inf:
            raise ValueError(f"priority_aging_per_second must be > 0 and finite (with 0, a stream of better-ranked "
                             f"requests could starve one forever), got {self.priority_aging_per_second}")
        for name in ("priority_tool_boost", "priority_short_boost", "scheduler_delay_factor"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be >= 0 and finite, got {getattr(self, name)}")
        if self.priority_short_max_tokens < 0:
            raise ValueError(f"priority_short_max_tokens must be >= 0, got {self.priority_short_max_tokens}")
        if self.target_itl_ms is not None and not 0.0 < self.target_itl_ms < math.inf:
            raise ValueError(f"target_itl_ms must be > 0 and finite (or None: off), got {self.target_itl_ms}")
        if not 0.0 <= self.swap_space < math.inf:
            raise ValueError(f"swap_space must be >= 0 GiB and finite, got {self.swap_space}")
        host, limit = swap_space_limit()
        if self.swap_space > limit:
            raise ValueError(f"swap_space {self.swap_space:g} GiB is more than 70% of this machine's "
                             f"{host:.1f} GiB of memory ({limit:.1f} GiB)")
        if self.preemption_mode not in (None, "swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode 'swap' needs swap space: set swap_space > 0 GiB")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cuda_graph_max_tokens < 0:
            raise ValueError(f"cuda_graph_max_tokens must be >= 0, got {self.cuda_graph_max_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.preemption_mode == "swap":
            raise ValueError(f"preemption_mode 'swap' is not supported with tensor_parallel_size="
                             f"{self.tensor_parallel_size} (each rank would have to swap its own KV heads); "
                             "preempted requests recompute")

    def check_tensor_parallel(self, model: ModelConfig, device: torch.device) -> None:
        """Refuses a tensor_parallel_size that does not split the model evenly, or a device whose
        multi-process path is not built."""
        n = self.tensor_parallel_size
        if n == 1:
            return
        if device.type != "cpu":
            raise ValueError(f"tensor_parallel_size={n} runs on the CPU only (gloo process group); the "
                             f"{device.type} path (NCCL, all-reduces inside CUDA graphs) is not implemented")
        for name in ("num_key_value_heads", "num_attention_heads", "intermediate_size", "vocab_size"):
            if getattr(model, name) % n:
                raise ValueError(f"tensor_parallel_size={n} must divide the model's {name}="
                                 f"{getattr(model, name)} (each rank holds an equal share)")

    def resolve_device(self) -> torch.device:
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device {self.device!r} is not a device: auto, cpu, cuda or cuda:N") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: this machine's torch sees no CUDA device")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {self.device!r}: this machine's torch sees {torch.cuda.device_count()} CUDA "
                             f"devices (cuda:0..cuda:{torch.cuda.device_count() - 1})")
        return device

    def resolve_dtype(self, model_config: ModelConfig, device: torch.device) -> torch.dtype:
        import torch
        if self.dtype != "auto":
            return parse_dtype(self.dtype)
        if device.type == "cpu":
            return torch.float32
        return model_config.dtype if model_config.dtype != torch.float32 else torch.bfloat16

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        import torch
        return model_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn


def swap_space_limit() -> tuple[float, float]:
    """This machine's memory and the most swap space its engine cores may pin together, GiB: vLLM's bound, 70%
    (the swap space is pinned host memory, the rest of the machine needs the rest)."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return host, 0.7 * host


def priority_refusal(priority: int, policy: str) -> str | None:
    """Why a request of `priority` is refused under the scheduling `policy` (None: it is not): a priority is
    honoured only by the priority policy, and one the scheduler would ignore is refused rather than dropped. The
    engine refuses it, and a frontend that knows the core's policy (`CoreReady`) refuses it before answering."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not -2**63 <= priority < 2**63:
        return f"priority must be an integer in [-2**63, 2**63), got {priority!r}"
    if priority and policy != "priority":
        return (f"priority {priority} is only honoured under the priority scheduling policy (--scheduling-policy "
                f"priority); this engine's is {policy!r}")
    return None
