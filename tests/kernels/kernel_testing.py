"""Shared by the kernel tests: the device they run on, random inputs and a scattered paged cache.

Without a GPU the kernels run under Triton's interpreter (switched on in conftest.py) on small shapes,
half precision as float16: the interpreter keeps bfloat16 as raw uint16 (its tl.dot multiplies the bit
patterns, its casts truncate). With a GPU the same tests run compiled on it, half precision as
bfloat16, and the `gpu`-marked tests add realistic bfloat16 sizes.
"""
from __future__ import annotations

import pytest
import torch

from tokenmill.layers.attention import store_kvcache_torch
from tokenmill.layers.norm import rms_norm_torch
from tokenmill.layers.rotary import apply_rotary_torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
HALF = torch.bfloat16 if HAS_CUDA else torch.float16
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=torch.float32, gen=None) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen, spare_blocks=3):
    """Random cache with each sequence's blocks scattered over a random permutation of block ids."""
    blocks_per_seq = [-(-c // block_size) for c in seq_lens]
    max_blocks = max(max(blocks_per_seq), 1) + 1
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = perm[used:used + n].int()
        used += n
    k_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    return k_cache, v_cache, table.to(DEVICE)


def _tol(dtype):
    return {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


def _prologue_reference(qkv, positions, cos_sin, q_weight, k_weight, eps, k_cache, v_cache, slots,
                        num_heads, num_kv_heads, head_dim, kv_scale=None):
    """The unfused attention prologue: split, per-head RMSNorm, RoPE, KV-cache store (quantized with
    `kv_scale` into an FP8 cache)."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    if q_weight is not None:
        q, _ = rms_norm_torch(q, q_weight, eps)
        k, _ = rms_norm_torch(k, k_weight, eps)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    q, k = apply_rotary_torch(q, cos, sin), apply_rotary_torch(k, cos, sin)
    store_kvcache_torch(k, v, k_cache, v_cache, slots, kv_scale)
    return q


def fp8_model_tokens(path: str, backend, long_prompt: int = 30, **llm_kwargs) -> list:
    """An FP8 model (quantized at load) on `backend`, CPU, float32: three prompts at once (the third of
    `long_prompt` tokens), two greedy tokens each with their top-2 log-probs, as [(token ids, logprobs)]."""
    from tokenmill import LLM, SamplingParams
    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=3, quantization="fp8", **llm_kwargs)
    llm.engine.runner.model.use_backend(backend)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 31, 7, 200, 3, 3, 41], [12, 40, 6], [(7 * i) % 500 for i in range(long_prompt)]]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
