"""Gemma 3 (`Gemma3ForCausalLM`, and the text of `Gemma3ForConditionalGeneration`): the Llama decoder with four
norms a layer (`post_norms`), RMSNorm weights stored as offsets from 1, GELU's tanh approximation, the embeddings
times sqrt(hidden_size), q.k scaled by query_pre_attn_scalar ** -0.5, q/k norm, and sliding layers that rotate with
their own RoPE base. A tiny random checkpoint saved by transformers (random norm weights, so that 1 + w is not 1;
layers of both kinds with distinct bases; query_pre_attn_scalar not head_dim) is served with transformers' logprobs
and greedy tokens; served with the scale, the local base or the activation at another value it is not. Its sliding
layers' window (16) is far shorter than the sequences served. A tiny multimodal checkpoint's text is
served as transformers computes it. The config's reading is checked against transformers' own (old config.json keys,
a sparse text_config, transformers 5's rope_parameters), and its refusals on config.json dicts."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig

from served_sequence import assert_gpu_equals_cpu_engine, sequence_logprobs, transformers_logprobs

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
# hidden_size 72: the embeddings' scale sqrt(72) = 8.485 is 8.5 in bfloat16
TEXT = dict(vocab_size=128, hidden_size=72, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, query_pre_attn_scalar=24,
            sliding_window=16, layer_types=LAYER_TYPES, rope_theta=1e4, rope_local_base_freq=100.0,
            bos_token_id=None, eos_token_id=2, pad_token_id=0)
PROMPT = [(37 * i + 11) % 128 for i in range(100)]
# the prompt's logprobs over a prefill chunked by 32 tokens, then 20 greedy tokens with theirs: 120 tokens, past the
# sliding layers' window of 16
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0, prompt_logprobs=0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _random_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Every RMSNorm weight (transformers initialises them 0: a norm times 1 + 0) drawn at random."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    return model


def _served(model_dir: str, **engine_args):
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_batched_tokens=32, **engine_args)
    return (llm, *sequence_logprobs(llm.generate([PROMPT], PARAMS)[0], PROMPT))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(checkpoint directory, the engine serving it, its greedy tokens, its logprobs)"""
    path = str(tmp_path_factory.mktemp("gemma3"))
    torch.manual_seed(0)
    model = _random_norms(Gemma3ForCausalLM(Gemma3TextConfig(**TEXT)))
    model.generation_config.eos_token_id = [1, 106]         # gemma-3's <eos> and <end_of_turn>
    model.save_pretrained(path)
    return (path, *_served(path))


def test_gemma3_equals_transformers(gemma3):
    """Prompt logprobs over a chunked prefill, then greedy tokens and their logprobs past the prompt, as transformers
    computes them; the sliding layers share one table of the local base, the full ones the other, the head is the
    embedding table (scaled), and q.k is scaled by 24 ** -0.5."""
    path, llm, tokens, ours = gemma3
    want = transformers_logprobs(path, PROMPT, tokens)
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    model = llm.engine.runner.model
    tables = [layer.self_attn.rotary for layer in model.model.layers]
    assert (tables[0].theta, tables[1].theta) == (100.0, 1e4) and tables[2] is tables[0] and tables[3] is tables[1]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {layer.self_attn.attn.scale for layer in model.model.layers} == {24 ** -0.5}
    assert model.config.sliding_layers == (True, False, True, False) and model.config.sliding_window == 16
    assert llm.engine.eos_token_ids == {2, 1, 106}       # config.json's and generation_config.json's


def test_bfloat16_embeddings_are_transformers_to_the_bit(gemma3):
    """In bfloat16 the scaled embedding rows are transformers' to the bit: sqrt(72) rounded to the model's dtype
    (8.5) before it scales the table, as transformers casts it, not 8.485."""
    path = gemma3[0]
    ours = LLM(path, device="cpu", dtype="bfloat16").engine.runner.model.model.embed_tokens.weight
    model = Gemma3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours, model.model.embed_tokens(torch.arange(TEXT["vocab_size"])))


@pytest.mark.parametrize("override", [{"query_pre_attn_scalar": 16},
                                      {"rope_parameters": {"sliding_attention": {"rope_theta": 1e4}}},
                                      {"hidden_activation": "silu"}])
def test_each_reading_moves_the_output(gemma3, override):
    """Served with the softmax scale at Llama's (1/sqrt(head_dim)), the sliding layers at the full ones' base, or
    SiLU for GELU, the logprobs move by more than 0.01: the test above would see any of them read wrong."""
    path, _, _, ours = gemma3
    _, _, other = _served(path, hf_overrides=override)
    assert (other[:len(PROMPT) - 1] - ours[:len(PROMPT) - 1]).abs().max() > 0.01


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A Gemma3ForConditionalGeneration checkpoint (its vision tower tiny), as transformers saves it."""
    path = str(tmp_path_factory.mktemp("gemma3_multimodal"))
    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    text = {**TEXT, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}      # the 4B's, on the full layers
    _random_norms(Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=125, boi_token_index=126,
        eoi_token_index=127))).save_pretrained(path)
    return path


def test_multimodal_checkpoint_serves_its_text(multimodal, tmp_path, caplog):
    """The language model of a Gemma3ForConditionalGeneration checkpoint, served as text: transformers' logprobs
    and greedy tokens of the whole model on text alone (linear RoPE scaling on the full layers); the vision tower's
    and projector's tensors are skipped, said once. Its tensors under transformers 5's in-memory names
    (model.language_model.*) load alike."""
    with caplog.at_level("INFO", logger="tokenmill"):
        _, tokens, ours = _served(multimodal)
    want = transformers_logprobs(multimodal, PROMPT, tokens)
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    assert "skipping the 34 tensors under vision_tower., multi_modal_projector." in caplog.text
    renamed = str(tmp_path / "renamed")
    os.makedirs(renamed)
    state = load_file(os.path.join(multimodal, "model.safetensors"))
    save_file({("model." + k.replace("language_model.model.", "language_model.")
                if not k.startswith("language_model.lm_head") else k): v for k, v in state.items()},
              os.path.join(renamed, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(multimodal, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(renamed, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert torch.equal(_served(renamed)[2], ours)


GEMMA3_1B = dict(architectures=["Gemma3ForCausalLM"], vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                 num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                 hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768, query_pre_attn_scalar=256,
                 rms_norm_eps=1e-6, rope_local_base_freq=10000, rope_scaling=None, rope_theta=1000000,
                 sliding_window=512, sliding_window_pattern=6, attn_logit_softcapping=None,
                 final_logit_softcapping=None, eos_token_id=[1, 106], bos_token_id=2, torch_dtype="bfloat16")
GEMMA3_4B = dict(architectures=["Gemma3ForConditionalGeneration"], eos_token_id=[1, 106], torch_dtype="bfloat16",
                 text_config=dict(hidden_size=2560, intermediate_size=10240, model_type="gemma3_text",
                                  num_hidden_layers=34, rope_scaling={"factor": 8.0, "rope_type": "linear"},
                                  sliding_window=1024),
                 vision_config=dict(hidden_size=1152, model_type="siglip_vision_model"))


def _transformers_reading(hf: dict) -> Gemma3TextConfig:
    text = hf.get("text_config", hf)
    return Gemma3TextConfig(**{k: v for k, v in text.items() if k not in ("architectures", "torch_dtype")})


@pytest.mark.parametrize("hf", [GEMMA3_1B, GEMMA3_4B,
                                {**GEMMA3_1B, "rope_parameters": {"full_attention": {"rope_type": "default",
                                                                                    "rope_theta": 5e5}}},
                                {**GEMMA3_1B, "layer_types": ["full_attention"] * 13 + ["sliding_attention"] * 13},
                                {**GEMMA3_1B, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}],
                         ids=["1b", "4b", "rope_parameters", "layer_types", "soft_caps"])
def test_config_reads_gemma3_as_transformers_does(hf):
    """gemma-3-1b-it's and gemma-3-4b-it's config.json (the latter's sparse text_config on transformers' defaults),
    and transformers 5's keys: each layer's kind, the RoPE of each kind, the sizes, as transformers reads them; soft
    caps (none on Gemma 3's own checkpoints), which transformers' Gemma3 applies where a config sets them, as Gemma
    2's."""
    cfg, want = ModelConfig.from_hf(hf), _transformers_reading(hf)
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in want.layer_types)
    assert cfg.sliding_window == want.sliding_window
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (want.attn_logit_softcapping,
                                                                         want.final_logit_softcapping)
    full, local = want.rope_parameters["full_attention"], want.rope_parameters["sliding_attention"]
    assert (cfg.rope_theta, cfg.local_rope_theta, local["rope_type"]) == (full["rope_theta"], local["rope_theta"],
                                                                           "default")
    assert (cfg.rope_scaling or {}).get("factor") == full.get("factor")
    assert (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_act) == (
        want.vocab_size, want.num_attention_heads, want.num_key_value_heads, want.head_dim, want.hidden_activation)
    assert (cfg.attention_scale, cfg.embedding_multiplier) == (want.query_pre_attn_scalar ** -0.5,
                                                               want.hidden_size ** 0.5)
    assert (cfg.eos_token_ids, cfg.tie_word_embeddings, cfg.qk_norm, cfg.post_norms) == ((1, 106), True, True, True)


@pytest.mark.parametrize("change,message", [
    ({"attn_logit_softcapping": 0.0}, r"attn_logit_softcapping is 0.0; it must be a positive number"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention is not supported"),
    ({"sliding_window": None}, r"sliding_window is None; Gemma3ForCausalLM's sliding layers need an integer >= 1"),
    ({"layer_types": ["full_attention"] * 3}, r"layer_types is .* for each of the num_hidden_layers=26 layers"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     r"sliding layers with RoPE of type 'linear' are not supported"),
    ({"hidden_activation": "gelu"}, r"hidden_act is 'gelu'; supported: silu, gelu_pytorch_tanh"),
])
def test_config_refuses_what_is_not_served(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**GEMMA3_1B, **change})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_gemma3_on_the_gpu_equals_the_cpu_engine(gemma3, max_num_seqs):
    """The Triton kernels (GELU in gate_up's product, the post-norms beside the single-token products, each layer's
    own RoPE table in the prologue and the one-kernel decode), under CUDA graphs, at one and at four sequences: the
    CPU engine's greedy tokens, logprobs within float32 kernel rounding."""
    path, _, tokens, logprobs = gemma3
    assert_gpu_equals_cpu_engine(path, PROMPT, PARAMS, tokens, logprobs, max_num_seqs, max_num_batched_tokens=32)
