"""The tiny Qwen3 model bundled with the package (trained by `tokenmill.tiny.train`), the default model."""
from __future__ import annotations

import importlib.resources

BUNDLED_MODEL_NAME = "tokenmill-tiny"


def bundled_model_path() -> str:
    """Directory of the bundled model (config.json, model.safetensors, tokenizer with a ChatML template)."""
    return str(importlib.resources.files("tokenmill") / "assets" / "tiny")
