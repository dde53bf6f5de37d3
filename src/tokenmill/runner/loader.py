"""Builds a model from a local directory or GGUF file: config -> registry -> streamed, packed weights."""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.models.registry import get_model_class
from tokenmill.runner.fill import fill_parameters
from tokenmill.runner.gguf_loader import load_gguf_weights

def weight_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir!r} (tokenmill loads local "
                                "safetensors checkpoints only; .bin/.pt files are not supported)")
    return files


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Streams every safetensors tensor of `model_dir` into its (possibly packed) parameter."""
    device = next(model.parameters()).device

    def tensors():
        for path in weight_files(model_dir):
            with safe_open(path, framework="pt", device=str(device)) as f:
                for key in f.keys():
                    yield key, lambda f=f, key=key: f.get_tensor(key)
    fill_parameters(model, tensors(), repr(model_dir))


def load_model(model_path: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`model_path`: a Hugging Face directory (safetensors) or a `.gguf` file."""
    model = build_model(cfg, device, dtype)
    if is_gguf(model_path):
        load_gguf_weights(model, model_path)
    else:
        load_weights(model, model_path)
    return model.eval()


def is_gguf(path: str) -> bool:
    return str(path).lower().endswith(".gguf") and os.path.isfile(path)
