"""The model's kernel paths (`models/llama.py`) through the engine on the CPU, each bound as a backend
(`layers/backend.py`) that runs one kernel beside the references: each one-token step through the
single-token products, each decode step through the one-kernel attention, each eager prefill step through
a tile map, give the tokens of the reference path."""
from __future__ import annotations

import pytest

from kernel_testing import HAS_CUDA
from tokenmill.layers.backend import TorchBackend
from tokenmill.layers.kernel_config import DecodeAttentionConfig, RegisterTile
from tokenmill.layers.kernels import decode_attention as da, gemv, paged_attention as pa


def _generate(model_dir, config, prompts, params, backend=None):
    from tokenmill import LLM
    llm = LLM(model_dir, **config)
    if backend is not None:
        llm.engine.runner.model.use_backend(backend)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU every one-token step takes this path anyway")
def test_single_token_layers_give_the_composed_layers_tokens(model_dir):
    """Every one-token step through the fused single-token layer (norms folded into the products,
    SiLU-and-mul into gate_up, the residual carried by the kernels) gives the tokens of the composed
    layer, for each architecture (qkv bias, q/k norm, GQA group 5)."""
    from tokenmill import SamplingParams
    prompts = [[5, 9, 31, 7, 200, 3, 3, 41], [12]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    config = dict(device="cpu", dtype="float32", max_num_seqs=1)
    expected = _generate(model_dir, config, prompts, params)
    calls = []

    def fused(*args, **kwargs):
        calls.append(kwargs.get("act") is not None)
        return gemv.fused_linear(*args, tile=RegisterTile(32, 64, 4, 2), **kwargs)

    class SingleToken(TorchBackend):
        def single_token_linear(self, input_ids):
            return fused if input_ids.shape[0] == 1 else None
    assert _generate(model_dir, config, prompts, params, SingleToken()) == expected
    assert calls.count(True) > 0 and len(calls) == 4 * calls.count(True)


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU every one-token step takes this path anyway")
def test_gemma3_single_token_layers_give_the_composed_layers_tokens(tmp_path):
    """Gemma 3's one-token steps through the single-token products: GELU folded into gate_up, its norms after
    o_proj and down_proj run between the products, the norms before them folded in; the composed layer's tokens."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tokenmill import SamplingParams
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64, bos_token_id=None,
        eos_token_id=2, pad_token_id=0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(str(tmp_path))
    prompts = [[5, 9, 31, 7, 200, 3, 3, 41], [12]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    config = dict(device="cpu", dtype="float32", max_num_seqs=1)
    expected = _generate(str(tmp_path), config, prompts, params)
    acts = []

    def fused(*args, **kwargs):
        acts.append(kwargs.get("act"))
        return gemv.fused_linear(*args, tile=RegisterTile(32, 64, 4, 2), **kwargs)

    class SingleToken(TorchBackend):
        def single_token_linear(self, input_ids):
            return fused if input_ids.shape[0] == 1 else None
    assert _generate(str(tmp_path), config, prompts, params, SingleToken()) == expected
    assert acts.count("gelu_pytorch_tanh") > 0 and len(acts) == 4 * acts.count("gelu_pytorch_tanh")


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU every decode step takes this path anyway")
def test_engine_decode_through_the_one_kernel_attention(model_dir):
    """Every decode step with its attention in the one fused kernel (split-K with the in-kernel merge)
    gives the tokens of the composed attention, for each architecture (qkv bias, q/k norm, GQA 5)."""
    from tokenmill import SamplingParams
    prompts = [[5, 9, 31, 7, 200, 3, 3, 41] * 4, [12], [7, 7, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    config = dict(device="cpu", dtype="float32", block_size=4)
    expected = _generate(model_dir, config, prompts, params)
    batches = []

    def fused(qkv, *args, into=None, **kwargs):
        batches.append(qkv.shape[0])
        return da.fused_decode_attention(qkv, *args, num_splits=3, config=DecodeAttentionConfig(16, min_split_len=16),
                                         **kwargs)

    class OneKernelDecode(TorchBackend):
        def decode_attention(self, input_ids, meta):
            return fused if meta.is_pure_decode(input_ids.shape[0]) else None
    assert _generate(model_dir, config, prompts, params, OneKernelDecode()) == expected
    assert batches and max(batches) > 1


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU every eager step with prefill tokens takes this path anyway")
def test_engine_eager_prefill_attention_through_a_tile_map(qwen3_dir):
    """A step with prefill tokens that runs eagerly hands the prefill kernel a tile map of every
    prefill chunk's query blocks (as graphs do; decode rows are the decode-rows kernel's): through
    them the kernels give the tokens of the reference attention, with long prompts chunked beside
    decode rows."""
    from tokenmill import SamplingParams
    prompts = [[5, 9, 31, 7, 200, 3, 3, 41] * 20, [12], [7, 7, 8] * 30, [3, 1, 4, 1, 5]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    config = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=200)
    expected = _generate(qwen3_dir, config, prompts, params)
    steps = []

    class TiledPrefill(TorchBackend):
        def attend(self, q, k_cache, v_cache, meta, scale, kv_scale=None, into=None, window=None, softcap=None):
            if meta.is_pure_decode(q.shape[0]):
                return super().attend(q, k_cache, v_cache, meta, scale, kv_scale, window=window, softcap=softcap)
            steps.append((meta.prefill_tiles, meta.query_start_loc.diff().tolist()))
            return pa.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                              meta.query_start_loc, meta.max_query_len, scale,
                                              tiles=meta.prefill_tiles, kv_scale=kv_scale, window=window,
                                              softcap=softcap)
    assert _generate(qwen3_dir, config, prompts, params, TiledPrefill()) == expected
    assert all(tiles is not None for tiles, _ in steps)
    # a chunk of two query blocks beside other sequences took place, one tile per block
    assert any(len(lens) > 1 and max(lens) > 64 for _, lens in steps)
    assert all(tiles.shape[1] == sum(-(-n // 64) for n in lens if n > 1) for tiles, lens in steps)
    assert any(1 in lens for _, lens in steps)          # decode rows beside a chunk

