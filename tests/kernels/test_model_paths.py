"""The model's kernel paths (`models/llama.py`) through the engine on the CPU: each one-token step through
the single-token products, each decode step through the one-kernel attention, each eager prefill step
through a tile map, give the tokens of the reference path."""
from __future__ import annotations

import pytest

from kernel_testing import HAS_CUDA
from tokenmill.layers.kernel_config import DecodeAttentionConfig, RegisterTile
from tokenmill.layers.kernels import paged_attention as pa, gemv, decode_attention as da


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU every one-token step takes this path anyway")
def test_single_token_layers_give_the_composed_layers_tokens(model_dir, monkeypatch):
    """Every one-token step through the fused single-token layer (norms folded into the products,
    SiLU-and-mul into gate_up, the residual carried by the kernels) gives the tokens of the composed
    layer, for each architecture (qkv bias, q/k norm, GQA group 5)."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.models import llama
    prompts = [[5, 9, 31, 7, 200, 3, 3, 41], [12]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    config = dict(device="cpu", dtype="float32", max_num_seqs=1)
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, **config).generate(prompts, params)]
    calls = []

    def fused(*args, **kwargs):
        calls.append(kwargs.get("silu", False))
        return gemv.fused_linear(*args, tile=RegisterTile(32, 64, 4, 2), **kwargs)
    monkeypatch.setattr(llama, "single_token_linear", lambda h, kernels: fused if h.shape[0] == 1 else None)
    got = [o.outputs[0].token_ids for o in LLM(model_dir, **config).generate(prompts, params)]
    assert got == expected
    assert calls.count(True) > 0 and len(calls) == 4 * calls.count(True)

@pytest.mark.skipif(HAS_CUDA, reason="on a GPU every decode step takes this path anyway")
def test_engine_decode_through_the_one_kernel_attention(model_dir, monkeypatch):
    """Every decode step with its attention in the one fused kernel (split-K with the in-kernel merge)
    gives the tokens of the composed attention, for each architecture (qkv bias, q/k norm, GQA 5)."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.models import llama
    prompts = [[5, 9, 31, 7, 200, 3, 3, 41] * 4, [12], [7, 7, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    config = dict(device="cpu", dtype="float32", block_size=4)
    expected = [o.outputs[0].token_ids for o in LLM(model_dir, **config).generate(prompts, params)]
    batches = []

    def fused(qkv, *args, **kwargs):
        batches.append(qkv.shape[0])
        return da.fused_decode_attention(qkv, *args, num_splits=3, config=DecodeAttentionConfig(16, min_split_len=16),
                                         **kwargs)
    monkeypatch.setattr(llama, "decode_attention_kernel",
                        lambda h, meta, kernels: fused if meta.is_pure_decode(h.shape[0]) else None)
    got = [o.outputs[0].token_ids for o in LLM(model_dir, **config).generate(prompts, params)]
    assert got == expected
    assert batches and max(batches) > 1


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU every eager step with prefill tokens takes this path anyway")
def test_engine_eager_prefill_attention_through_a_tile_map(qwen3_dir, monkeypatch):
    """A step with prefill tokens that runs eagerly hands the prefill kernel a tile map of every
    sequence's query blocks (as graphs do): through that map the kernel gives the tokens of the
    reference attention, with long prompts chunked beside decode rows."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.attention import PagedAttention
    prompts = [[5, 9, 31, 7, 200, 3, 3, 41] * 20, [12], [7, 7, 8] * 30, [3, 1, 4, 1, 5]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    config = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=200)
    expected = [o.outputs[0].token_ids for o in LLM(qwen3_dir, **config).generate(prompts, params)]
    reference, steps = PagedAttention.attend, []

    def attend(self, q, meta):
        if meta.is_pure_decode(q.shape[0]):
            return reference(self, q, meta)
        steps.append((meta.prefill_tiles, meta.query_start_loc.diff().tolist()))
        return pa.paged_prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, meta.max_query_len, self.scale,
                                          tiles=meta.prefill_tiles)
    monkeypatch.setattr(PagedAttention, "attend", attend)
    got = [o.outputs[0].token_ids for o in LLM(qwen3_dir, **config).generate(prompts, params)]
    assert got == expected
    assert all(tiles is not None for tiles, _ in steps)
    # a chunk of two query blocks beside other sequences took place, one tile per block
    assert any(len(lens) > 1 and max(lens) > 64 for _, lens in steps)
    assert all(tiles.shape[1] == sum(-(-n // 64) for n in lens) for tiles, lens in steps)
