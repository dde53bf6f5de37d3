"""Roofline floor: the least time one GPU could take for a request set under an ideal schedule.

Model. All requests arrive at time zero and are served by an ideal continuous-batching scheduler with the
engine's limits: at most `max_num_seqs` running, at most `max_num_batched_tokens` tokens per step, first
come first served. Every step gives each running request whose prompt is done one decode token; the rest of
the token budget goes to prompt chunks (chunked prefill), oldest request first, admitting waiting requests
while there is room. A request's last prompt chunk yields its first output token, so a request of P prompt
and O output tokens computes P + O - 1 tokens. Each step costs

    time = max(bytes / memory_bandwidth, (projection flops / matmul_rate + other flops) / matmul_peak)

    bytes = weight_bytes + kv_bytes_per_token * sum(cached tokens read + new tokens written)
    flops = 2 * matmul_params * new_tokens + 2 * lm_head_params * sampled_tokens
            + 4 * layers * q_heads * head_dim * (query, key) pairs under the causal mask

- weight_bytes: every parameter read once per step at the model dtype's size, except an untied input
  embedding table, of which a step reads only the gathered rows (tied: the table is read as the LM head).
- kv_bytes_per_token = 2 (K and V) * layers * kv_heads * head_dim * dtype size: an ideal attention kernel
  reads each running sequence's cache once per step, whatever its number of query tokens.
- matmul_params: the decoder's projections (q/k/v/o, gate/up/down); lm_head_params = vocab * hidden.
- Quantized weights and cache (`ModelCost.from_model_config`'s `quantization` and `kv_cache_dtype`, as the
  engine takes them): FP8 projections are one byte a parameter and, as W8A8, run on the FP8 tensor cores
  at twice the 16-bit peak (`matmul_rate` 2); 4-bit ones (AWQ, GPTQ: W4A16) half a byte plus a 16-bit
  scale and a 4-bit zero a group of input columns, at the 16-bit peak. The head and the embedding stay in
  the model dtype, as the engine keeps them. An FP8 cache is one byte a value. Per-channel and per-layer
  scales (under 0.2% of the bytes) are left out.
- Ignored, so the floor stays a lower bound: activations, norms, rotary, sampling, kernel launches,
  host work, and the KV capacity limit (no preemption). Defaults are one H200: 4.3e12 B/s measured device
  copy bandwidth and 790e12 FLOP/s dense bf16 matmul.

The measured time divided by the floor says how far an engine is from what the hardware allows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

H200_MEMORY_BANDWIDTH = 4.3e12
H200_MATMUL_FLOPS = 790e12


@dataclass(frozen=True)
class Hardware:
    memory_bandwidth: float = H200_MEMORY_BANDWIDTH    # bytes/s
    matmul_flops: float = H200_MATMUL_FLOPS            # FLOP/s
    name: str = "H200"


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: float             # read once per step
    matmul_params: int              # decoder projection weights, applied to every new token
    lm_head_params: int             # applied to sampled positions only
    kv_bytes_per_token: int
    attn_flops_per_pair: int        # 4 * layers * q_heads * head_dim
    matmul_rate: float = 1.0        # the projections' FLOP rate as a multiple of the 16-bit peak

    @classmethod
    def from_model_config(cls, mc, dtype_bytes: int = 2, quantization: str | None = None,
                          kv_cache_dtype: str = "auto", group_size: int = 128) -> "ModelCost":
        """The cost of `mc` with weights in `dtype_bytes`, or its projections in `quantization` ("fp8",
        "awq", "gptq"; 4-bit with `group_size` columns a scale), and the cache in the model dtype
        (`kv_cache_dtype` "auto") or FP8."""
        if quantization == "fp8":
            param_bytes, rate = 1.0, 2.0
        elif quantization in ("awq", "gptq"):
            param_bytes, rate = 0.5 + 2.5 / group_size, 1.0
        elif quantization is None:
            param_bytes, rate = float(dtype_bytes), 1.0
        else:
            raise ValueError(f"roofline: unknown quantization {quantization!r}; known: fp8, awq, gptq")
        kv_bytes = dtype_bytes if kv_cache_dtype == "auto" else 1     # as EngineConfig.resolve_kv_cache_dtype
        h, hd = mc.hidden_size, mc.head_dim
        q, kv = mc.num_attention_heads * hd, mc.num_key_value_heads * hd
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * mc.intermediate_size
        matmul = mc.num_hidden_layers * per_layer
        small = mc.num_hidden_layers * (2 * h + (2 * hd if mc.qk_norm else 0)
                                        + ((q + 2 * kv) if mc.attention_bias else 0)) + h
        embed = mc.vocab_size * h
        return cls(
            weight_bytes=matmul * param_bytes + float((small + embed) * dtype_bytes),
            matmul_params=matmul,
            lm_head_params=embed,
            kv_bytes_per_token=2 * mc.num_hidden_layers * mc.num_key_value_heads * hd * kv_bytes,
            attn_flops_per_pair=4 * mc.num_hidden_layers * mc.num_attention_heads * hd,
            matmul_rate=rate,
        )

    @staticmethod
    def num_params(mc) -> int:
        """Parameter count of the checkpoint (the untied LM head counted)."""
        cost = ModelCost.from_model_config(mc, dtype_bytes=1)
        return int(cost.weight_bytes) + (0 if mc.tie_word_embeddings else cost.lm_head_params)


@dataclass
class Floor:
    seconds: float
    num_steps: int
    memory_bound_steps: int
    total_bytes: float
    total_flops: float
    output_tokens: int
    total_tokens: int

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        return {"floor_s": self.seconds, "floor_steps": self.num_steps,
                "floor_memory_bound_steps": self.memory_bound_steps, "floor_bytes": self.total_bytes,
                "floor_flops": self.total_flops, "floor_output_tok_s": self.output_throughput}


def roofline_floor(prompt_lens, output_lens, cost: ModelCost, max_num_seqs: int = 256,
                   max_num_batched_tokens: int = 8192, hw: Hardware = Hardware()) -> Floor:
    prompt = np.asarray(prompt_lens, dtype=np.int64)
    output = np.asarray(output_lens, dtype=np.int64)
    if prompt.shape != output.shape or (prompt < 1).any() or (output < 1).any():
        raise ValueError("prompt_lens and output_lens must be equally long lists of positive lengths")
    n = len(prompt)
    computed = np.zeros(n, dtype=np.int64)      # tokens whose K/V are in the cache
    generated = np.zeros(n, dtype=np.int64)
    running: list[int] = []
    next_waiting = 0
    seconds = total_bytes = total_flops = 0.0
    steps = memory_steps = 0
    while next_waiting < n or running:
        budget = max_num_batched_tokens
        while next_waiting < n and len(running) < max_num_seqs:
            running.append(next_waiting)
            next_waiting += 1
        idx = np.asarray(running, dtype=np.int64)
        remaining_prompt = np.maximum(prompt[idx] - computed[idx], 0)
        decoding = remaining_prompt == 0
        new = decoding.astype(np.int64)
        budget -= int(new.sum())
        for j in np.flatnonzero(~decoding).tolist():     # prompt chunks, oldest first
            if budget <= 0:
                break
            take = min(int(remaining_prompt[j]), budget)
            new[j] = take
            budget -= take
        if new.sum() == 0:
            raise ValueError("max_num_batched_tokens too small to make progress")
        past = computed[idx]
        sampled = (past + new >= prompt[idx]) & (new > 0)
        pairs = int((new * past + new * (new + 1) // 2).sum())
        step_bytes = cost.weight_bytes + cost.kv_bytes_per_token * float((past + new)[new > 0].sum())
        proj_flops = 2.0 * cost.matmul_params * float(new.sum())
        other_flops = 2.0 * cost.lm_head_params * float(sampled.sum()) + float(cost.attn_flops_per_pair) * pairs
        step_flops = proj_flops + other_flops
        t_mem = step_bytes / hw.memory_bandwidth
        t_flop = (proj_flops / cost.matmul_rate + other_flops) / hw.matmul_flops
        seconds += max(t_mem, t_flop)
        memory_steps += t_mem >= t_flop
        total_bytes += step_bytes
        total_flops += step_flops
        steps += 1
        computed[idx] += new
        generated[idx] += sampled
        running = [i for i in running if generated[i] < output[i]]
    return Floor(seconds, steps, int(memory_steps), total_bytes, total_flops,
                 int(output.sum()), int(prompt.sum() + output.sum()))


def decode_floor_ms_per_token(cost: ModelCost, context_len: int = 0, hw: Hardware = Hardware()) -> float:
    """Batch-1 decode: the weights plus one sequence's cache read per output token."""
    return 1e3 * (cost.weight_bytes + cost.kv_bytes_per_token * (context_len + 1)) / hw.memory_bandwidth
