"""Hugging Face transformers baselines, loading the same checkpoint directory as tokenmill.

- `hf-static`: the naive deployment. Requests in input order, `batch_size` at a time, left-padded, through
  `model.generate` (greedy, eos disabled). A batch runs to the longest requested output in it
  (`max_new_tokens` = the batch's max), but only each request's own requested output tokens count as useful
  output, so the padding and the overrun of shorter requests are charged to the baseline, as they are in
  production.
- `hf-cb`: transformers' own continuous batching (`init_continuous_batching`), one request per prompt with
  its own `max_new_tokens`, eos disabled, greedy. `max_memory_percent` caps the KV cache (0.5 by default:
  larger fractions ran out of memory once CUDA graphs were captured).

Both return the generated token ids per request, in input order; timing is done by the caller.
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable

import torch

from tokenmill.bench.datasets import BenchRequest


def load_hf_model(model_path: str, dtype: torch.dtype, device: torch.device, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn_implementation)
    model.to(device).eval()
    model.generation_config.eos_token_id = None      # ignore_eos for every request
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFStatic:
    def __init__(self, model_path: str, dtype: torch.dtype, device: torch.device, batch_size: int = 64,
                 attn_implementation: str = "sdpa"):
        self.device = device
        self.batch_size = batch_size
        self.model = load_hf_model(model_path, dtype, device, attn_implementation)
        self.pad_token_id = 0

    @torch.inference_mode()
    def _generate_batch(self, batch: list[BenchRequest]) -> list[list[int]]:
        from transformers import GenerationConfig

        width = max(r.prompt_len for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            input_ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            attention_mask[i, width - r.prompt_len:] = 1
        max_new = max(r.output_len for r in batch)
        config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                                  eos_token_id=None, pad_token_id=self.pad_token_id)
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                  generation_config=config)
        new_tokens = out[:, width:].tolist()
        return [ids[:r.output_len] for ids, r in zip(new_tokens, batch)]

    def warmup(self) -> None:
        self._generate_batch([BenchRequest([1] * 16, 4)] * 2)
        _sync(self.device)

    def generate(self, requests: list[BenchRequest], progress: Callable[[int], None] | None = None) -> list[list[int]]:
        results: list[list[int]] = []
        for start in range(0, len(requests), self.batch_size):
            batch = requests[start:start + self.batch_size]
            results.extend(self._generate_batch(batch))
            if progress is not None:
                progress(len(batch))
        _sync(self.device)
        return results


def default_cb_attn_implementation() -> str:
    """The paged SDPA implementation under the name this transformers version registers, else 'sdpa'."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        names = list(ALL_ATTENTION_FUNCTIONS.keys())
    except Exception:
        names = []
    for name in ("paged|sdpa", "sdpa_paged"):
        if name in names:
            return name
    return "sdpa"


class HFContinuousBatching:
    def __init__(self, model_path: str, dtype: torch.dtype, device: torch.device, max_memory_percent: float = 0.5,
                 max_batch_tokens: int | None = None, attn_implementation: str | None = None,
                 workload: list[BenchRequest] | None = None):
        from transformers import GenerationConfig

        self.device = device
        self.attn_implementation = attn_implementation or default_cb_attn_implementation()
        self.model = load_hf_model(model_path, dtype, device, self.attn_implementation)
        max_new = max((r.output_len for r in workload), default=16) if workload else 16
        gen_config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
        kwargs = {"generation_config": gen_config}
        cb_fields = {"max_memory_percent": max_memory_percent}
        if max_batch_tokens is not None:
            cb_fields["max_batch_tokens"] = max_batch_tokens
        params = inspect.signature(self.model.init_continuous_batching).parameters
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            ContinuousBatchingConfig = None
        if ContinuousBatchingConfig is not None and "continuous_batching_config" in params:
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**cb_fields)
        else:       # older releases read these fields from the generation config
            for key, value in cb_fields.items():
                setattr(gen_config, key, value)
        if workload and "workload_hints" in params:
            from transformers.generation.continuous_batching.utils import WorkloadHints
            kwargs["workload_hints"] = WorkloadHints(
                max_prompt_length=max(r.prompt_len for r in workload),
                max_generated_length=max_new, num_requests=len(workload))
        self.manager = self.model.init_continuous_batching(**kwargs)
        self._per_request_max = "max_new_tokens" in inspect.signature(self.manager.add_request).parameters
        self.manager.start()
        self._counter = 0

    def warmup(self) -> None:
        self.generate([BenchRequest([1] * 16, 4), BenchRequest([2] * 24, 4)])

    def generate(self, requests: list[BenchRequest], progress: Callable[[int], None] | None = None,
                 timeout_s: float = 3600.0) -> list[list[int]]:
        ids = []
        for r in requests:
            request_id = f"bench-{self._counter}"
            self._counter += 1
            kwargs = {"max_new_tokens": r.output_len} if self._per_request_max else {}
            self.manager.add_request(input_ids=list(r.prompt_token_ids), request_id=request_id, **kwargs)
            ids.append(request_id)
        pending = set(ids)
        done: dict[str, list[int]] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"hf-cb: {len(pending)} requests unfinished after {timeout_s:.0f} s")
            result = self.manager.get_result(timeout=1)
            if result is None:
                if hasattr(self.manager, "is_running") and not self.manager.is_running():
                    raise RuntimeError("hf-cb: the generation thread stopped")
                continue
            if result.request_id not in pending or not result.is_finished():
                continue
            if getattr(result, "error", None):
                raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
            pending.discard(result.request_id)
            done[result.request_id] = list(result.generated_tokens)
            if progress is not None:
                progress(1)
        _sync(self.device)
        return [done[i][:r.output_len] for i, r in zip(ids, requests)]

    def close(self) -> None:
        try:
            self.manager.stop(block=True, timeout=30)
        except Exception:
            pass
