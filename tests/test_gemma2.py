"""Gemma 2 (`Gemma2ForCausalLM`): Gemma 3's decoder without q/k norm and with one RoPE base, its every other layer
sliding, and soft caps: every attention score s becomes attn_logit_softcapping x tanh(s / attn_logit_softcapping)
before the softmax, every logit final_logit_softcapping x tanh(logit / final_logit_softcapping). A tiny random
checkpoint saved by transformers (random norm weights, weights large enough that caps of 2 and 3 bite, a window of 16
under 120 tokens, layer_types left to Gemma2Config's default) is served with the logprobs and greedy tokens of
transformers' eager attention (its sdpa refuses the model: it cannot cap scores); served without either cap it is
not. The config's reading is checked against transformers' own, and its refusals on config.json dicts."""
from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.layers.attention import paged_attention_torch
from tokenmill.layers.backend import TorchBackend

from served_sequence import assert_gpu_equals_cpu_engine, sequence_logprobs, transformers_logprobs

# initializer_range 0.1: scores and logits far enough past the caps of 2 and 3 that dropping either moves the
# logprobs by 0.3 or more (transformers' 0.02 leaves both caps all but idle)
CONFIG = dict(vocab_size=128, hidden_size=72, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, query_pre_attn_scalar=24,
              sliding_window=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, initializer_range=0.1,
              bos_token_id=None, eos_token_id=2, pad_token_id=0)
PROMPT = [(37 * i + 11) % 128 for i in range(100)]
# the prompt's logprobs over a prefill chunked by 32 tokens, then 20 greedy tokens with theirs: 120 tokens, past the
# sliding layers' window of 16
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0, prompt_logprobs=0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _served(model_dir: str, backend: TorchBackend | None = None, **engine_args):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=32, **engine_args)
    if backend is not None:
        llm.engine.runner.model.use_backend(backend)
    return (llm, *sequence_logprobs(llm.generate([PROMPT], PARAMS)[0], PROMPT))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """(checkpoint directory, the engine serving it, its greedy tokens, its logprobs)"""
    path = str(tmp_path_factory.mktemp("gemma2"))
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(**CONFIG))
    with torch.no_grad():           # transformers initialises the norms 0: a norm times 1 + 0
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    model.generation_config.eos_token_id = [1, 107]          # gemma-2's <eos> and <end_of_turn>
    model.save_pretrained(path)
    return (path, *_served(path))


def test_gemma2_equals_transformers(gemma2):
    """Prompt logprobs over a chunked prefill, then greedy tokens and their logprobs past the prompt, as transformers'
    eager attention computes them (which caps the scores; sdpa refuses a Gemma 2 model); the layers from the first
    on alternate sliding and full, all with one RoPE table, and the head is the (scaled) embedding table."""
    path, llm, tokens, ours = gemma2
    want = transformers_logprobs(path, PROMPT, tokens, attn_implementation="eager")
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    with pytest.raises(ValueError, match="does not support an attention implementation through torch.nn.functional"):
        Gemma2ForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    model = llm.engine.runner.model
    cfg = model.config
    assert (cfg.sliding_layers, cfg.sliding_window, cfg.local_rope_theta) == ((True, False, True, False), 16, None)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.qk_norm) == (2.0, 3.0, False)
    assert len({id(layer.self_attn.rotary) for layer in model.model.layers}) == 1
    assert {(layer.self_attn.attn.scale, layer.self_attn.attn.softcap) for layer in model.model.layers} == {
        (24 ** -0.5, 2.0)}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert llm.engine.eos_token_ids == {2, 1, 107}       # config.json's and generation_config.json's


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_each_cap_moves_the_output(gemma2, cap):
    """Served with either cap null (none), the logprobs move by more than 0.01: the test above would see either cap
    left out of the scores or the logits."""
    path, _, _, ours = gemma2
    _, _, other = _served(path, hf_overrides={cap: None})
    assert (other[:len(PROMPT) - 1] - ours[:len(PROMPT) - 1]).abs().max() > 0.01


def test_decode_attention_gets_the_layers_cap(gemma2):
    """A backend that runs each decode step's attention as one function from the packed qkv (as the Triton backend's
    one-kernel decode) is handed every layer's cap, and with it gives the composed path's tokens and logprobs."""
    path, _, tokens, ours = gemma2
    caps = []

    class OneFunctionDecode(TorchBackend):
        def decode_attention(self, input_ids, meta):
            if not meta.is_pure_decode(input_ids.shape[0]):
                return None

            def attend(qkv, positions, cos_sin, q_weight, k_weight, eps, k_cache, v_cache, slots, block_tables,
                       seq_lens, scale, num_heads, num_kv_heads, head_dim, kv_scale=None, into=None, window=None,
                       softcap=None):
                caps.append(softcap)
                q = self.qk_norm_rope_store(qkv, positions, cos_sin, q_weight, k_weight, eps, k_cache, v_cache, slots,
                                            num_heads, num_kv_heads, head_dim, kv_scale)
                qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
                return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale, kv_scale,
                                             window, softcap)
            return attend
    _, got_tokens, got = _served(path, OneFunctionDecode())
    assert got_tokens == tokens and torch.allclose(got, ours, atol=1e-5)
    assert len(caps) == 4 * (PARAMS.max_tokens - 1) and set(caps) == {2.0}


# the sizes and keys of gemma-2-2b-it's and gemma-2-9b-it's config.json (the 9b's left sparse, on Gemma2Config's
# defaults)
GEMMA2_2B = dict(architectures=["Gemma2ForCausalLM"], attention_bias=False, attn_logit_softcapping=50.0,
                 bos_token_id=2, eos_token_id=[1, 107], final_logit_softcapping=30.0, head_dim=256,
                 hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", hidden_size=2304,
                 intermediate_size=9216, max_position_embeddings=8192, num_attention_heads=8, num_hidden_layers=26,
                 num_key_value_heads=4, pad_token_id=0, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
                 rope_theta=10000.0, sliding_window=4096, torch_dtype="float32", vocab_size=256000)
GEMMA2_9B = dict(architectures=["Gemma2ForCausalLM"], hidden_size=3584, intermediate_size=14336,
                 num_attention_heads=16, num_hidden_layers=42, num_key_value_heads=8, torch_dtype="bfloat16")


@pytest.mark.parametrize("hf", [GEMMA2_2B, GEMMA2_9B, {**GEMMA2_2B, "final_logit_softcapping": None},
                                {**GEMMA2_2B, "layer_types": ["full_attention"] * 20 + ["sliding_attention"] * 6},
                                {**GEMMA2_2B, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}],
                         ids=["2b", "9b", "no_final_cap", "layer_types", "rope_scaling"])
def test_config_reads_gemma2_as_transformers_does(hf):
    """Each layer's kind, the window, the caps (a null one: none), the RoPE (one base and scaling for every layer),
    the sizes and the scale, as transformers' Gemma2Config reads them, its defaults where config.json is silent."""
    cfg = ModelConfig.from_hf(hf)
    want = Gemma2Config(**{k: v for k, v in hf.items() if k not in ("architectures", "torch_dtype")})
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in want.layer_types)
    assert (cfg.sliding_window, cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (
        want.sliding_window, want.attn_logit_softcapping, want.final_logit_softcapping)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (want.rope_parameters["rope_theta"], None)
    assert (cfg.rope_scaling or {}).get("factor") == want.rope_parameters.get("factor")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.hidden_act, cfg.max_position_embeddings) == (
        want.vocab_size, want.hidden_size, want.num_hidden_layers, want.num_attention_heads, want.num_key_value_heads,
        want.head_dim, want.hidden_activation, want.max_position_embeddings)
    assert (cfg.attention_scale, cfg.embedding_multiplier) == (want.query_pre_attn_scalar ** -0.5,
                                                               want.hidden_size ** 0.5)
    assert (cfg.tie_word_embeddings, cfg.qk_norm, cfg.post_norms, cfg.norm_unit_offset) == (True, False, True, True)


@pytest.mark.parametrize("change,message", [
    ({"attn_logit_softcapping": 0}, r"attn_logit_softcapping is 0; it must be a positive number .* or null: none"),
    ({"final_logit_softcapping": -30.0}, r"final_logit_softcapping is -30.0; it must be a positive number"),
    ({"final_logit_softcapping": "30"}, r"final_logit_softcapping is '30'; it must be a positive number"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention is not supported"),
    ({"sliding_window": None}, r"sliding_window is None; Gemma2ForCausalLM's sliding layers need an integer >= 1"),
    ({"layer_types": ["sliding_attention"] * 3}, r"layer_types is .* for each of the num_hidden_layers=26 layers"),
    ({"hidden_activation": "gelu"}, r"hidden_act is 'gelu'; supported: silu, gelu_pytorch_tanh"),
    ({"attention_bias": True}, r"Gemma2ForCausalLM with attention_bias is not supported"),
])
def test_config_refuses_what_is_not_served(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**GEMMA2_2B, **change})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_gemma2_on_the_gpu_equals_the_cpu_engine(gemma2, max_num_seqs):
    """The Triton kernels with the cap as a constexpr (the prefill and decode-rows kernels, the one-kernel decode,
    within the sliding layers' window) and the capped logits under CUDA graphs (the argmax kernel reading them), at
    one and at four sequences: the CPU engine's greedy tokens, logprobs within float32 kernel rounding."""
    path, _, tokens, logprobs = gemma2
    assert_gpu_equals_cpu_engine(path, PROMPT, PARAMS, tokens, logprobs, max_num_seqs, max_num_batched_tokens=32)
