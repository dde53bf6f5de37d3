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

# keys some checkpoints carry that hold no learned state
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def fill_parameters(model: nn.Module, tensors, source: str) -> None:
    """Copies `(hf_key, read)` pairs into the model's (possibly packed) parameters, calling `read()`
    only for keys the model uses, so one checkpoint tensor at a time is materialised. Ends by checking
    that every parameter (every shard of a packed one) was filled and no key was left over; `source`
    names the checkpoint in those errors."""
    cfg: ModelConfig = model.config
    params = dict(model.named_parameters())
    filled: dict[str, set[int]] = {name: set() for name in params}
    leftover: list[str] = []
    for key, read in tensors:
        if key.endswith(_IGNORED_SUFFIXES) or (key == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        name, shard = _target(model, key)
        if name not in params:
            leftover.append(key)
            continue
        tensor = read()
        param = params[name]
        if shard is None:
            _copy(param.data, tensor, key)
            filled[name].add(0)
        else:
            sizes = model.shard_sizes(name.split(".")[-2])
            start = sum(sizes[:shard])
            _copy(param.data.narrow(0, start, sizes[shard]), tensor, key)
            filled[name].add(shard)
        del tensor
    if leftover:
        raise ValueError(f"checkpoint keys not used by {cfg.architecture}: {leftover[:8]}"
                         f"{' ...' if len(leftover) > 8 else ''} ({len(leftover)} in all)")
    missing = []
    for name, shards in filled.items():
        packed = name.split(".")[-2]
        want = len(model.shard_sizes(packed)) if packed in ("qkv_proj", "gate_up_proj") else 1
        if len(shards) < want:
            missing.append(name)
    if missing:
        raise ValueError(f"parameters missing from the checkpoint {source}: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)")


def _target(model: nn.Module, key: str) -> tuple[str, int | None]:
    for shard_name, (packed, index) in model.packed_modules.items():
        part = f".{shard_name}."
        if part in key:
            return key.replace(part, f".{packed}."), index
    return key, None


def _copy(dst: torch.Tensor, src: torch.Tensor, key: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(src.shape)}, "
                         f"the model expects {tuple(dst.shape)}")
    dst.copy_(src)


def load_model(model_path: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`model_path`: a Hugging Face directory (safetensors) or a `.gguf` file."""
    model = build_model(cfg, device, dtype)
    if is_gguf(model_path):
        from tokenmill.runner.gguf_loader import load_gguf_weights
        load_gguf_weights(model, model_path)
    else:
        load_weights(model, model_path)
    return model.eval()


def is_gguf(path: str) -> bool:
    return str(path).lower().endswith(".gguf") and os.path.isfile(path)
