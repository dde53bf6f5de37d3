"""Random-weight models with the exact shapes of real ones, so benchmarks run without downloads.

Presets have random weights and no tokenizer: they take prompts as lists of token ids only (text needs
`tokenizer=DIR`, a tokenizer whose ids fit the preset's vocabulary). A text prompt is refused before the
build where the prompts are known first (`tokenmill generate`), and at `generate()` otherwise.

`PRESETS` holds Hugging Face config.json dicts. `resolve_model_path("preset:NAME")` materialises such a
model once (config.json + safetensors written by transformers' `save_pretrained`) in a cache directory and
returns its path; tokenmill and the transformers baselines then load the very same weights from it.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

PRESET_PREFIX = "preset:"

_QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "use_sliding_window": False,
    "sliding_window": None,
    "use_cache": True,
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "vocab_size": 151936,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-4b": {
        **_QWEN3_COMMON,
        "num_hidden_layers": 36,
        "max_window_layers": 36,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "num_hidden_layers": 28,
        "max_window_layers": 28,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
    "nanbeige4.1-3b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "num_hidden_layers": 32,
        "hidden_size": 2560,
        "intermediate_size": 10496,
        "num_attention_heads": 20,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 166144,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 70000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 65536,
        "bos_token_id": 166100,
        "eos_token_id": 166101,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    },
    # A Qwen3-shaped model small enough for CPU tests.
    "test-tiny": {
        **_QWEN3_COMMON,
        "num_hidden_layers": 2,
        "max_window_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "bos_token_id": 510,
        "eos_token_id": [511, 510],
        "max_position_embeddings": 4096,
    },
}


def is_preset(model: str) -> bool:
    return isinstance(model, str) and model.startswith(PRESET_PREFIX)


def check_text_prompts(model: str | None, tokenizer: str | None) -> None:
    """Raises for text prompts to a preset without a tokenizer, naming what it takes instead."""
    if is_preset(model) and tokenizer is None:
        vocab = preset_config(model)["vocab_size"]
        raise ValueError(f"{model} is a random-weight preset without a tokenizer: it takes prompts as lists of "
                         f"token ids (each below its vocabulary size {vocab}), not text; pass tokenizer=DIR "
                         "(--tokenizer DIR) for text prompts")


def preset_config(model: str, config_override: dict | None = None) -> dict[str, Any]:
    """The config.json dict of `preset:NAME` (or `NAME`), with `config_override` applied on top."""
    name = model[len(PRESET_PREFIX):] if is_preset(model) else model
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return {**PRESETS[name], **(config_override or {})}


def preset_dir(name: str, dtype: str = "bfloat16", seed: int = 0, cache_dir: str | None = None) -> str:
    root = cache_dir or os.path.join(
        os.environ.get("TOKENMILL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill"),
        "presets")
    return os.path.join(root, f"{name}-{dtype}-s{seed}")


def _is_complete(path: str) -> bool:
    if not os.path.isfile(os.path.join(path, "config.json")):
        return False
    return (os.path.isfile(os.path.join(path, "model.safetensors"))
            or os.path.isfile(os.path.join(path, "model.safetensors.index.json")))


def resolve_model_path(model: str, dtype: str = "bfloat16", seed: int = 0, cache_dir: str | None = None,
                       config_override: dict | None = None) -> str:
    """`preset:NAME` -> path of a materialised random-weight model directory; anything else unchanged.

    The directory is keyed by name, dtype and seed and built at most once: it is written to a temporary
    sibling and renamed into place, so a directory at the final path is always complete.
    `config_override` (tests) changes the shapes and must then come with its own `cache_dir`.
    """
    if not is_preset(model):
        return model
    if dtype in (None, "auto"):
        dtype = "bfloat16"
    name = model[len(PRESET_PREFIX):]
    config = preset_config(name, config_override)
    path = preset_dir(name, dtype, seed, cache_dir)
    if _is_complete(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=os.path.dirname(path))
    try:
        _materialise(config, tmp, dtype, seed)
        try:
            os.rename(tmp, path)
        except OSError:
            if not _is_complete(path):      # someone else's partial directory: replace it
                shutil.rmtree(path, ignore_errors=True)
                os.rename(tmp, path)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _materialise(config: dict[str, Any], out_dir: str, dtype: str, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenmill.config import parse_dtype

    torch_dtype = parse_dtype(dtype)
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    hf_config.architectures = list(config["architectures"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        # Transformers' own init: normal(0, initializer_range=0.02) for linear and embedding, ones for norms.
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "tokenmill_preset.json"), "w") as f:
        json.dump({"dtype": dtype, "seed": seed, "device": str(device)}, f)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
