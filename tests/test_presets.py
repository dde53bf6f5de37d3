import json
import os

import pytest
import torch

from tokenmill.config import ModelConfig
from tokenmill.models.presets import PRESETS, preset_config, resolve_model_path


def test_real_shapes():
    q = ModelConfig.from_hf(PRESETS["qwen3-4b"])
    assert (q.num_hidden_layers, q.hidden_size, q.intermediate_size) == (36, 2560, 9728)
    assert (q.num_attention_heads, q.num_key_value_heads, q.head_dim, q.vocab_size) == (32, 8, 128, 151936)
    assert q.tie_word_embeddings and q.qk_norm and q.eos_token_ids == (151645, 151643)
    assert q.kv_bytes_per_token == 144 * 1024
    n = ModelConfig.from_hf(PRESETS["nanbeige4.1-3b"])
    assert n.architecture == "LlamaForCausalLM" and not n.qk_norm and not n.tie_word_embeddings
    assert (n.num_hidden_layers, n.intermediate_size, n.num_attention_heads, n.num_key_value_heads) == (32, 10496, 20, 4)
    assert (n.vocab_size, n.rope_theta, n.rms_norm_eps, n.eos_token_ids, n.bos_token_id) == (
        166144, 7e7, 1e-5, (166101,), 166100)
    s = ModelConfig.from_hf(PRESETS["qwen3-0.6b"])
    assert (s.num_hidden_layers, s.hidden_size, s.intermediate_size, s.num_attention_heads) == (28, 1024, 3072, 16)


def test_non_preset_passes_through():
    assert resolve_model_path("/some/dir") == "/some/dir"
    with pytest.raises(ValueError):
        preset_config("preset:no-such-model")


def test_materialise_tiny_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("preset:test-tiny", cache_dir=str(tmp_path), config_override={"num_hidden_layers": 1})
    assert os.path.isfile(os.path.join(path, "config.json"))
    assert [p for p in os.listdir(tmp_path) if "tmp" in p] == []
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 1
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    std = model.model.layers[0].mlp.down_proj.weight.float().std().item()
    assert 0.015 < std < 0.025
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert resolve_model_path("preset:test-tiny", cache_dir=str(tmp_path)) == path     # reused, not rebuilt
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
