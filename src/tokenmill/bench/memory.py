"""`tokenmill bench memory`: KV memory of the paged cache against a static, contiguous per-request cache.

Workloads (lengths are prompt + output tokens; every request generates `output_len` tokens with eos
ignored, the rest of its length is a random token-id prompt):
- concurrent: `num_concurrent` requests, lengths uniform in `concurrent_len_range` (10 of 500-2,000);
- mixed: `num_mixed` requests, lengths log-uniform in `mixed_len_range` (32 of 50-8,000): as many requests
  of 50-400 tokens as of 1,000-8,000, a chat mix of many short and a few long requests (the articles give
  only the range);
- long: `num_long` requests of exactly `long_len` tokens (8 of 8,192).

Each workload runs through the real engine on its own `LLMEngine`, with every prompt prefilled in one step
(`max_num_batched_tokens` >= the workload's prompt tokens) and prefix caching off, so all requests decode in
lockstep and are resident at their full length at the last step: the moment a static cache must be sized
for. The engine's `num_kv_blocks` leaves one spare block per request, so nothing is preempted (checked).

Definitions (t = KV bytes per token = 2 * layers * kv_heads * head_dim * dtype size; bs = block size):
- needed: sum(L - 1) * t. A request of L tokens holds the K/V of L - 1 of them: its last sampled token is
  never fed back.
- paged: the block manager's measured `peak_blocks_used` * block bytes (block bytes = bs * t). Computed,
  it is sum(ceil((L - 1) / bs)) blocks, which the tests check against the engine.
- static, reserve the longest: every request reserves the workload's longest length, as transformers'
  static cache does for one padded `generate()` batch (max_cache_len = longest prompt + max_new_tokens).
- static, reserve max_model_len: every request reserves a contiguous slot of `max_model_len` tokens, as a
  naive server (or a static cache sized to the context) does for each concurrent request.
- waste = (reserved - needed) / reserved; saving = 1 - paged / static.

Maximum concurrency for a KV budget of B bytes: paged, floor(floor(B / block bytes) / blocks per request),
with blocks per request the workload's measured peak over its requests (for the long workload exactly
ceil((long_len - 1) / bs)); static, floor(B / (reserve * t)) with reserve = max_model_len (and, in the JSON
and the 8K column, the model's own context: max_position_embeddings, or YaRN's longer one). B is measured on
the device from a second engine with the serving settings (`max_num_batched_tokens`, `max_num_seqs`,
`gpu_memory_utilization`): its `num_blocks` * block bytes. For a GPU of G GiB it is computed:
B = G * 2**30 * gpu_memory_utilization - weight bytes (parameters from the config, at the checkpoint's
dtype) - an allowance for activations, the CUDA context and the allocator (`overhead_gib`). The device run
also reports the overhead it measured: total * gpu_memory_utilization - weights - KV budget.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass

import numpy as np

GIB = 2**30


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    lengths: tuple[int, ...]        # prompt + output tokens of each request
    output_len: int

    @property
    def num_requests(self) -> int:
        return len(self.lengths)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.lengths) - self.output_len * self.num_requests

    @property
    def kv_tokens(self) -> int:
        return sum(n - 1 for n in self.lengths)

    def paged_blocks(self, block_size: int) -> int:
        return sum(blocks_per_request(n, block_size) for n in self.lengths)

    def prompts(self, vocab_size: int, specials: set[int], seed: int) -> list[list[int]]:
        from tokenmill.bench.datasets import sampleable_token_ids

        allowed = sampleable_token_ids(vocab_size, specials)
        rng = np.random.default_rng([seed, 1])
        return [allowed[rng.integers(0, len(allowed), n - self.output_len)].tolist() for n in self.lengths]


def blocks_per_request(length: int, block_size: int) -> int:
    return -(-(length - 1) // block_size)


def make_workloads(concurrent: tuple[int, tuple[int, int]], mixed: tuple[int, tuple[int, int]],
                   long: tuple[int, int], output_len: int, seed: int = 0) -> list[Workload]:
    """`concurrent` and `mixed` are (requests, (lo, hi)) and `long` is (requests, length). The lengths
    depend on the seed only, not on the model, so every model runs the same lengths."""
    (nc, (clo, chi)), (nm, (mlo, mhi)), (nl, long_len) = concurrent, mixed, long
    if min(clo, mlo, long_len) <= output_len:
        raise ValueError(f"every length must exceed --output-len {output_len} (a prompt of at least 1 token)")
    rng = np.random.default_rng(seed)
    short = rng.integers(clo, chi + 1, size=nc)
    mix = np.clip(np.floor(np.exp(rng.uniform(math.log(mlo), math.log(mhi + 1), size=nm))), mlo, mhi)
    return [
        Workload("concurrent", f"{nc} requests, uniform {clo:,}-{chi:,} tokens", tuple(map(int, short)), output_len),
        Workload("mixed", f"{nm} requests, log-uniform {mlo:,}-{mhi:,} tokens", tuple(map(int, mix)), output_len),
        Workload("long", f"{nl} requests of {long_len:,} tokens", (long_len,) * nl, output_len),
    ]


def workload_row(w: Workload, paged_blocks: int, source: str, block_size: int, kv_bytes_per_token: int,
                 max_model_len: int, model_context: int) -> dict:
    t, n = kv_bytes_per_token, w.num_requests
    needed = w.kv_tokens * t
    paged = paged_blocks * block_size * t
    static = {"longest": n * max(w.lengths) * t, "max_model_len": n * max_model_len * t,
              "model_context": n * model_context * t}
    return {
        "workload": w.name, "description": w.description, "source": source, "num_requests": n,
        "total_tokens": sum(w.lengths), "kv_tokens": w.kv_tokens, "longest": max(w.lengths),
        "needed_bytes": needed, "paged_blocks": paged_blocks,
        "paged_blocks_formula": w.paged_blocks(block_size), "paged_bytes": paged,
        "paged_waste": 1 - needed / paged,
        **{f"static_{k}_bytes": v for k, v in static.items()},
        **{f"static_{k}_waste": 1 - needed / v for k, v in static.items()},
        **{f"paged_saving_vs_{k}": 1 - paged / v for k, v in static.items()},
    }


def concurrency(kv_budget_bytes: float, rows: list[dict], block_size: int, kv_bytes_per_token: int,
                max_model_len: int, model_context: int) -> dict:
    """Requests that fit in the budget at once: paged, of each workload's mix; static, one reservation each."""
    num_blocks = int(kv_budget_bytes // (block_size * kv_bytes_per_token))
    out = {"kv_budget_bytes": kv_budget_bytes, "num_blocks": num_blocks,
           "static_max_model_len": int(kv_budget_bytes // (max_model_len * kv_bytes_per_token)),
           "static_model_context": int(kv_budget_bytes // (model_context * kv_bytes_per_token))}
    for r in rows:
        # blocks per request averaged over the workload: num_blocks * n // peak blocks
        out[f"paged_{r['workload']}"] = num_blocks * r["num_requests"] // r["paged_blocks"]
        out[f"fits_paged_{r['workload']}"] = r["paged_bytes"] <= kv_budget_bytes
        out[f"fits_static_max_model_len_{r['workload']}"] = r["static_max_model_len_bytes"] <= kv_budget_bytes
    return out


def gpu_kv_budget(gpu_gib: float, gpu_memory_utilization: float, weight_bytes: float, overhead_gib: float) -> float:
    return max(0.0, gpu_gib * GIB * gpu_memory_utilization - weight_bytes - overhead_gib * GIB)


def _release() -> None:
    """Returns a dropped engine's GPU memory (reference cycles included) before the next engine allocates;
    on the CPU nothing waits for it."""
    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def measure_budget(model_path: str, args) -> dict:
    """The KV budget of an engine with the serving settings, as its own profile sized it. The cache is
    sized before CUDA graphs are captured, so `enforce_eager` leaves `num_blocks` as a server has it and
    saves the capture."""
    import torch

    from tokenmill import LLM
    from tokenmill.bench.throughput import hardware_name

    llm = LLM(model=model_path, dtype=args.dtype, device=args.device, block_size=args.block_size,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed, enforce_eager=True)
    runner = llm.engine.runner
    params = {p.data_ptr(): p for p in runner.model.parameters()}.values()      # tied weights once
    out = {"hardware": hardware_name(runner.device), "device": str(runner.device),
           "dtype": str(runner.dtype).replace("torch.", ""), "num_blocks": runner.num_blocks,
           "block_bytes": runner.block_bytes, "kv_budget_bytes": runner.num_blocks * runner.block_bytes,
           "weight_bytes": sum(p.numel() * p.element_size() for p in params),
           "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
           "gpu_memory_utilization": args.gpu_memory_utilization}
    if runner.device.type == "cuda":
        total = torch.cuda.mem_get_info(runner.device)[1]
        out["total_bytes"] = total
        out["overhead_bytes"] = total * args.gpu_memory_utilization - out["weight_bytes"] - out["kv_budget_bytes"]
    del llm, runner, params
    _release()
    if torch.cuda.is_available():
        out["allocated_after_release_bytes"] = torch.cuda.memory_allocated()
    return out


def measure_workload(model_path: str, w: Workload, args, vocab_size: int, specials: set[int]) -> dict:
    """Runs `w` on an engine of its own, so the block manager's peak counter is this workload's."""
    from tokenmill import LLM, SamplingParams

    # one spare block per request: room for all of them at full length, so none is preempted
    num_kv_blocks = w.paged_blocks(args.block_size) + w.num_requests
    batched = max(args.max_num_batched_tokens, w.prompt_tokens)
    llm = LLM(model=model_path, dtype=args.dtype, device=args.device, block_size=args.block_size,
              max_model_len=args.max_model_len, max_num_seqs=max(args.max_num_seqs, w.num_requests),
              max_num_batched_tokens=batched, num_kv_blocks=num_kv_blocks, enable_prefix_caching=False,
              seed=args.seed, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=w.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(w.prompts(vocab_size, specials, args.seed), params)
    elapsed = time.perf_counter() - t0
    stats = llm.engine.get_stats()
    short = sum(len(o.outputs[0].token_ids) != w.output_len for o in outputs)
    del llm, outputs
    _release()
    if stats["num_preemptions"] or short:
        raise RuntimeError(f"workload {w.name}: {stats['num_preemptions']} preemptions and {short} requests "
                           f"without {w.output_len} output tokens: the requests were not all resident at once")
    return {"peak_blocks_used": stats["peak_blocks_used"], "num_kv_blocks": num_kv_blocks,
            "max_num_batched_tokens": batched, "num_preemptions": 0, "elapsed_s": elapsed}


def study_model(model: str, model_path: str | None, workloads: list[Workload], args) -> dict:
    """All figures of one model: measured through the engine, or with `compute_only` from the formulas
    alone (no engine, no weights: `model_path` may be None for a preset)."""
    from tokenmill.bench.roofline import ModelCost
    from tokenmill.config import ModelConfig, parse_dtype
    from tokenmill.models.presets import is_preset, preset_config

    hf = preset_config(model) if is_preset(model) else None
    mc = ModelConfig.from_hf(hf if hf is not None else model_path)
    bs, mml, context = args.block_size, args.max_model_len, mc.derived_max_model_len
    # the 24 GB figures use the checkpoint's dtype, as a GPU serving it does
    ckpt_t = mc.kv_bytes_per_token
    result = {"model": model, "architecture": mc.architecture, "checkpoint_dtype": str(mc.dtype).replace("torch.", ""),
              "model_context": context, "weight_bytes_config": ModelCost.num_params(mc) * mc.dtype.itemsize}
    if args.compute_only:
        dtype = mc.dtype if args.dtype == "auto" else parse_dtype(args.dtype)
        t = ckpt_t // mc.dtype.itemsize * dtype.itemsize
        rows = [workload_row(w, w.paged_blocks(bs), "computed", bs, t, mml, context) for w in workloads]
        result.update(kv_bytes_per_token=t, dtype=str(dtype).replace("torch.", ""), workloads=rows)
    else:
        budget = measure_budget(model_path, args)
        t = budget["block_bytes"] // bs
        specials = set(mc.eos_token_ids) | ({mc.bos_token_id} if mc.bos_token_id is not None else set())
        rows = []
        for w in workloads:
            run = measure_workload(model_path, w, args, mc.vocab_size, specials)
            rows.append({**workload_row(w, run["peak_blocks_used"], "measured", bs, t, mml, context), **run})
        result.update(kv_bytes_per_token=t, dtype=budget["dtype"], workloads=rows, device_budget=budget,
                      device_concurrency=concurrency(budget["kv_budget_bytes"], rows, bs, t, mml, context))
    # the same lengths at the checkpoint's dtype, for the computed GPU
    gpu_rows = [workload_row(w, r["paged_blocks"], r["source"], bs, ckpt_t, mml, context)
                for w, r in zip(workloads, result["workloads"])]
    budget_24 = gpu_kv_budget(args.gpu_gib, args.gpu_memory_utilization, result["weight_bytes_config"],
                              args.overhead_gib)
    result["gpu_computed"] = {"gpu_gib": args.gpu_gib, "gpu_memory_utilization": args.gpu_memory_utilization,
                              "weight_bytes": result["weight_bytes_config"], "overhead_gib": args.overhead_gib,
                              "kv_bytes_per_token": ckpt_t,
                              **concurrency(budget_24, gpu_rows, bs, ckpt_t, mml, context)}
    return result

