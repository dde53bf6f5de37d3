"""Config features read as transformers reads them: RoPE (its dict under either name, its kind under
either key, its theta and original context by transformers' precedence), Qwen2's sliding-window defaults,
Qwen3's head_dim default, a tied checkpoint that stores the shared matrix as the head; and those not
served (biases on o_proj or the MLP) refused at load. The reference is transformers on the same config."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tokenmill import LLM
from tokenmill.config import ModelConfig
from tokenmill.layers.rotary import RotaryEmbedding

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=256)


def _saved(tmp_path, edit, config=LlamaConfig) -> str:
    """A config.json of a small model, as transformers writes it, then edited as older files are written."""
    config(**SMALL).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    hf["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[hf["model_type"]]]
    edit(hf)
    path.write_text(json.dumps(hf))
    return str(tmp_path)


def _drop_rope(hf):
    hf.pop("rope_parameters", None), hf.pop("rope_scaling", None), hf.pop("rope_theta", None)


@pytest.mark.parametrize("edit", [
    # the dict's theta before the top level's
    lambda hf: hf.update(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    lambda hf: (_drop_rope(hf), hf.update(rope_theta=500.0, rope_scaling={"type": "linear", "factor": 2.0,
                                                                          "rope_theta": 1e4})),
    # the older "type" key in rope_parameters
    lambda hf: hf.update(rope_parameters={"type": "linear", "factor": 4.0, "rope_theta": 1e4}),
    # llama3's original context: the top level's first, else the dict's, else max_position_embeddings
    lambda hf: hf.update(original_max_position_embeddings=16, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 1e4,
        "original_max_position_embeddings": 64}),
    lambda hf: hf.update(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "rope_theta": 1e4}),
    # YaRN: its attention factor from factor, or mscale over mscale_all_dim, or as given; its factor, where
    # null, max_position_embeddings over the original context; the band's bounds, truncated or not
    lambda hf: hf.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                          "rope_theta": 1e4}),
    lambda hf: hf.update(rope_parameters={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64,
                                          "beta_fast": 8, "beta_slow": 2, "truncate": False, "rope_theta": 1e6}),
    lambda hf: hf.update(rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                          "mscale": 0.7, "mscale_all_dim": 1.0, "rope_theta": 1e4}),
    lambda hf: hf.update(rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                                          "attention_factor": 1.5, "rope_theta": 1e4}),
], ids=["dict-theta", "legacy-dict-theta", "type-key", "top-level-original", "no-original", "yarn",
        "yarn-derived-factor", "yarn-mscale", "yarn-attention-factor"])
def test_rope_as_transformers_reads_it(tmp_path, edit):
    path = _saved(tmp_path, edit)
    cfg = ModelConfig.from_hf(path)
    ours = RotaryEmbedding(cfg.head_dim, 200, cfg.rope_theta, cfg.rope_scaling).cos_sin
    cos, sin = LlamaRotaryEmbedding(AutoConfig.from_pretrained(path))(torch.zeros(1), torch.arange(200)[None])
    half = cfg.head_dim // 2
    torch.testing.assert_close(ours, torch.cat((cos[0, :, :half], sin[0, :, :half]), -1), atol=2e-5, rtol=0)


def test_qwen2_sliding_defaults_and_qwen3_head_dim(tmp_path):
    def legacy(**keys):
        def edit(hf):
            hf.pop("layer_types", None), hf.pop("max_window_layers", None), hf.pop("sliding_window", None)
            hf.update(use_sliding_window=True, **keys)
        return edit
    # no window given: transformers' 4,096 from max_window_layers on, from layer 1 here
    cfg = ModelConfig.from_hf(_saved(tmp_path / "a", legacy(max_window_layers=1), Qwen2Config))
    assert (cfg.sliding_window, cfg.sliding_layers) == (4096, (False, True))
    # no max_window_layers: from layer 28 on, none of two layers slides
    cfg = ModelConfig.from_hf(_saved(tmp_path / "b", legacy(sliding_window=8), Qwen2Config))
    assert (cfg.sliding_window, cfg.sliding_layers) == (None, None)

    def qwen3(hf):
        hf.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
        hf.pop("head_dim", None)
    assert ModelConfig.from_hf(_saved(tmp_path / "c", qwen3)).head_dim == 128


@pytest.mark.parametrize("key,message", [("mlp_bias", "mlp_bias is not supported"),
                                         ("attention_bias", "attention_bias is not supported: it puts a bias on o_proj")])
def test_biases_not_served_are_refused(tmp_path, key, message):
    """The load failed listing the unused bias tensors, without naming the setting."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(_saved(tmp_path, lambda hf: hf.update({key: True})))


def test_a_tied_checkpoint_storing_the_matrix_as_the_head(tmp_path):
    """Tied embeddings written as lm_head.weight alone: transformers ties them either way; the load said the
    embedding was missing."""
    from safetensors.torch import load_file, save_file

    from tokenmill import LLM, SamplingParams
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["lm_head.weight"] = weights.pop("model.embed_tokens.weight")
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    prompt = [3, 9, 27, 17, 51]
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, 5:].tolist()
    out = LLM(str(tmp_path), device="cpu", dtype="float32").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == hf


@pytest.mark.parametrize("keys,message", [
    (dict(max_position_embeddings=0), "max_position_embeddings is 0; it must be an integer >= 1"),
    (dict(max_position_embeddings=-3), "max_position_embeddings is -3; it must be an integer >= 1"),
    (dict(num_attention_heads=4, num_key_value_heads=3, head_dim=8),
     "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (dict(hidden_size=24, num_attention_heads=8, num_key_value_heads=8, head_dim=3), "head_dim is 3; .* must be even"),
    # a negative or NaN one loaded a model of noise; a rope_theta of 0 was read as 10,000; null failed in float()
    (dict(max_position_embeddings=None), "max_position_embeddings is None; it must be an integer >= 1"),
    (dict(max_position_embeddings=2048.5), "max_position_embeddings is 2048.5; it must be an integer >= 1"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps is -1.0; it must be a finite number >= 0"),
    (dict(rms_norm_eps=None), "rms_norm_eps is None; it must be a finite number >= 0"),
    (dict(rms_norm_eps="abc"), "rms_norm_eps is 'abc'; it must be a finite number >= 0"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}),
     "rope_theta is nan; it must be a positive finite number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0}),
     "rope_theta is 0.0; it must be a positive finite number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -10000}),
     "rope_theta is -10000.0; it must be a positive finite number"),
])
def test_sizes_that_cannot_build_a_model_are_refused(tmp_path, keys, message):
    """A zero context failed in the start-up log (a division by zero), a negative one in torch (a RoPE table
    of negative length); KV heads that do not divide the query heads failed on the weights' shapes, and an odd
    head_dim loaded and failed on the first step's cache write."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(_saved(tmp_path, lambda hf: hf.update(keys)))


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "linear"}, r"type 'linear' needs factor as positive numbers; got factor=None"),
    ({"rope_type": "linear", "factor": 0}, r"got factor=0"),
    ({"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4},
     r"type 'llama3' needs factor, low_freq_factor, .*; got low_freq_factor=None, high_freq_factor=None"),
    ({"rope_type": "su", "factor": 4.0}, r"unsupported rope_scaling type 'su'; supported: default, linear, llama3, "
                                          r"yarn, longrope"),
    ({"rope_type": "longrope", "factor": 4.0}, r"type 'longrope' needs short_factor as 8 positive numbers, one per "
                                                r"rotary frequency of the 16 rotated dims of a head; got None"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7 + [0]},
     r"needs long_factor as 8 positive numbers, .*; got 8 values \[1.0, 1.0, 1.0, 1.0\]\.\.\."),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "long_mscale": 1.2},
     r"type 'longrope' with long_mscale=1.2 is not supported: transformers' LongRoPE has one attention factor"),
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope_scaling type 'dynamic' is not supported: dynamic NTK scaling "
                                              r"changes the frequencies with each sequence's length"),
    ({"rope_type": "yarn", "factor": "4"}, r"type 'yarn' needs factor, original_max_position_embeddings as positive "
                                           r"numbers; got factor='4'"),
    ({"rope_type": "yarn", "factor": 0.5}, r"type 'yarn' needs factor >= 1 \(the context's growth\); got factor=0.5"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1, "beta_slow": 32}, r"needs beta_fast >= beta_slow .*; got "
                                                                            r"beta_fast=1, beta_slow=32"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0}, r"attention_factor as a number > 0; got "
                                                                  r"attention_factor=0"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": "big"}, r"mscale_all_dim as numbers >= 0 .*; got mscale='big'"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}, r"takes truncate as true or false; got truncate='yes'"),
])
def test_rope_scaling_without_its_values_is_refused_naming_them(tmp_path, rope, message):
    """A scaled kind without the numbers it reads was a KeyError inside the RoPE table (a zero factor a
    table of infinities); a kind not implemented is named with those that are, dynamic with the reason no
    one table serves it."""
    cfg = ModelConfig.from_hf(_saved(tmp_path, lambda hf: (_drop_rope(hf), hf.update(rope_scaling=rope))))
    with pytest.raises(ValueError, match=message):
        RotaryEmbedding(cfg.head_dim, 16, cfg.rope_theta, cfg.rope_scaling)


@pytest.mark.parametrize("text,message", [
    ("{oops", r"config\.json: Expecting property name"),
    ("[]", r"config\.json: not a JSON object but a JSON list"),
    (json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "num_attention_heads": 2}),
     r"config\.json lacks hidden_size, intermediate_size, num_hidden_layers; a decoder's config needs vocab_size, "),
])
def test_a_config_json_that_cannot_be_read_is_named(tmp_path, text, message):
    """It was a bare JSONDecodeError, an AttributeError or a KeyError of the first key looked up."""
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(str(tmp_path))


def test_a_directory_holding_a_gguf_file_says_to_give_the_file(tmp_path):
    """A directory of a .gguf file and no config.json said only that config.json was missing."""
    (tmp_path / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"no config\.json at .*; it holds model-Q4_K_M\.gguf: a GGUF model is "
                                                r"given as the file itself"):
        ModelConfig.from_hf(str(tmp_path))


def test_a_tensor_twice_or_of_integers_is_refused(qwen3_dir, tmp_path):
    """A tensor in two shards of a checkpoint: the later file's copy replaced the earlier one unseen; integers
    where the model has float weights were cast. Either loaded a model of noise; each is refused by name."""
    weights = load_file(os.path.join(qwen3_dir, "model.safetensors"))
    names = sorted(weights)
    for case in ("twice", "integers"):
        model = tmp_path / case
        shutil.copytree(qwen3_dir, model)
        os.remove(model / "model.safetensors")
        first, second = {n: weights[n] for n in names[:3]}, {n: weights[n] for n in names[3:]}
        if case == "twice":
            second[names[0]] = torch.zeros_like(weights[names[0]])
        else:
            second[names[-1]] = weights[names[-1]].to(torch.int32)
        save_file(first, model / "model-00001-of-00002.safetensors")
        save_file(second, model / "model-00002-of-00002.safetensors")
        index = {n: f"model-0000{1 if n in first else 2}-of-00002.safetensors" for n in names}
        (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        message = (rf"checkpoint tensor '{names[0]}' appears twice" if case == "twice" else
                   rf"checkpoint tensor '{names[-1]}' is torch.int32, the model expects floating point")
        with pytest.raises(ValueError, match=message):
            LLM(str(model), device="cpu", dtype="float32")
