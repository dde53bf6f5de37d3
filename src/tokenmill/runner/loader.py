"""Builds a model from a local directory or GGUF file: config -> registry -> streamed, packed weights."""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.hf_config import TEXT_OF_MULTIMODAL
from tokenmill.layers.parallel import TensorParallel
from tokenmill.models.registry import get_model_class
from tokenmill.quant import fp8
from tokenmill.quant.formats import QUANTIZATION_ALIASES, Fp8Config
from tokenmill.quant.w4 import act_order_perm
from tokenmill.runner.fill import checkpoint_layout, fill_parameters, num_shards, packed_target, submodule
from tokenmill.runner.gguf_loader import load_gguf_weights

logger = logging.getLogger("tokenmill")


def weight_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                body = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{index!r} is not JSON: {e}") from None
        weight_map = body.get("weight_map") if isinstance(body, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index!r} has no weight_map (checkpoint key -> shard file)")
        names = set(weight_map.values())
        # a shard is a file of the model's own directory, named by a relative path
        bad = next((n for n in names if not isinstance(n, str) or os.path.isabs(n) or ".." in n.split("/")), None)
        if bad is not None:
            raise ValueError(f"{index!r} names the shard {bad!r}: a shard is a file in the model's directory")
        files = [os.path.join(model_dir, n) for n in sorted(names)]
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{index!r} lists the shard {os.path.basename(path)!r}, which is not in "
                                        f"{model_dir!r}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir!r} (tokenmill loads local "
                                "safetensors checkpoints only; .bin/.pt files are not supported)")
    return files


def _open(path: str, device: str):
    """`safe_open` with the file named in its errors: one bad shard of many (truncated by an interrupted
    download, not a safetensors file) is otherwise reported without saying which."""
    try:
        return safe_open(path, framework="pt", device=device)
    except SafetensorError as e:
        raise ValueError(f"cannot read checkpoint file {path!r}: {e}") from None


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                tp: TensorParallel | None = None) -> nn.Module:
    """`tp`: build rank tp.rank's slice of a tensor-parallel model (`layers/parallel.py`)."""
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg, tp)
    model = model.to(dtype)
    for module in model.modules():         # still on meta: packed 4-bit tensors keep their own dtypes
        if hasattr(module, "keep_checkpoint_dtypes"):
            module.keep_checkpoint_dtypes()
    # what nn.Module.to_empty does, without torch.empty_like: on a meta tensor that runs torch's Python
    # reference, whose first call imports sympy (0.4 s of every engine's start-up on the CPU machine)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Streams every safetensors tensor of `model_dir` into its (possibly packed) parameter. A GPTQ
    checkpoint's `g_idx` tensors are not kept: an act-order one gives its layer the order of its input
    rows (`w4.act_order_perm`, `W4Linear.set_act_order`), which the shards of a packed layer must share."""
    device = next(model.parameters()).device
    quant = model.config.quantization
    orders: dict[str, list[tuple[str, torch.Tensor | None]]] = {}      # layer -> (key, perm) of its shards

    files = weight_files(model_dir)
    names = _checkpoint_names(model.config, files, model_dir)     # stored key -> ours (None: skipped)

    def tensors():
        for path in files:
            with _open(path, str(device)) as f:
                for stored in f.keys():
                    key = names.get(stored, stored)
                    if key is None:
                        continue
                    if quant is not None and quant.method == "gptq" and key.endswith(".g_idx"):
                        layer = packed_target(model, key)[0].removesuffix(".g_idx")
                        module = submodule(model, layer)
                        if module is not None:          # else a key the model lacks, which fill reports
                            orders.setdefault(layer, []).append(
                                (key, act_order_perm(f.get_tensor(stored), module.in_features, quant.group_size, key)))
                            continue
                    yield key, lambda index=None, f=f, key=stored: (f.get_tensor(key) if index is None
                                                                    else f.get_slice(key)[index])
    fill_parameters(model, checkpoint_layout(model, tensors()), repr(model_dir))
    if quant is not None and quant.method == "gptq" and quant.desc_act:
        # act-order rows in the plain order would give wrong outputs without an error
        for name, module in model.named_modules():
            if hasattr(module, "set_act_order") and len(orders.get(name, ())) < num_shards(model, name):
                raise ValueError(f"gptq checkpoint {model_dir!r} has desc_act=true but not every g_idx of "
                                 f"{name!r} (act-order needs each layer's order of its input rows)")
    for layer, shards in orders.items():
        (first, perm), *rest = shards
        for key, other in rest:
            if (perm is None) != (other is None) or (perm is not None and not torch.equal(perm, other)):
                raise ValueError(f"checkpoint tensors {first!r} and {key!r} order the input rows of {layer!r} "
                                 "differently; its shards read one input and need one act-order")
        if perm is not None:
            model.get_submodule(layer).set_act_order(perm)


def _checkpoint_names(cfg: ModelConfig, files: list[str], model_dir: str) -> dict[str, str | None]:
    """The stored keys whose name in the model differs (None: skipped); a key not in it is the model's as
    stored. A multimodal checkpoint served as text (`hf_config.TEXT_OF_MULTIMODAL`) has its language model's
    tensors renamed and the rest (vision tower, projector) skipped, said once in the log; a tied checkpoint
    may store the shared matrix under the head's name alone (transformers ties it either way)."""
    text = TEXT_OF_MULTIMODAL.get(cfg.architecture)
    if text is None and not cfg.tie_word_embeddings:
        return {}
    stored = []
    for path in files:
        with _open(path, "cpu") as f:
            stored.extend(f.keys())
    names: dict[str, str | None] = {}
    if text is not None:
        renamed, skipped = text
        for key in stored:
            if key.startswith(skipped):
                names[key] = None
            else:
                names.update({key: ours + key[len(prefix):] for prefix, ours in renamed if key.startswith(prefix)})
        left_out = [key for key, ours in names.items() if ours is None]
        if left_out:
            logger.info("%s: serving its language model alone (text in, text out); skipping the %d tensors under "
                        "%s", model_dir, len(left_out),
                        ", ".join(p for p in skipped if any(key.startswith(p) for key in left_out)))
    ours = {names.get(key, key): key for key in stored}
    if cfg.tie_word_embeddings and "lm_head.weight" in ours and "model.embed_tokens.weight" not in ours:
        names[ours["lm_head.weight"]] = "model.embed_tokens.weight"
    return names


def load_model(model_path: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               quantization: str | None = None, tp: TensorParallel | None = None) -> nn.Module:
    """`model_path`: a Hugging Face directory (safetensors) or a `.gguf` file. `quantization` (the
    engine's): None takes the checkpoint's format, else it must be the checkpoint's; "fp8" on a plain
    checkpoint or a GGUF file quantizes its linear layers at load. `tp`: load rank tp.rank's slices only,
    from plain safetensors weights."""
    check_quantization(quantization, cfg, model_path)
    if tp is not None and (is_gguf(model_path) or quantization is not None or cfg.quantization is not None):
        what = ("is a GGUF file" if is_gguf(model_path) else "is quantized" if cfg.quantization is not None
                else f"would be quantized at load (--quantization {quantization})")
        raise ValueError(f"tensor_parallel_size={tp.size} loads plain safetensors checkpoints only, unquantized; "
                         f"{model_path!r} {what}")
    if cfg.quantization is not None and cfg.rope_dim != cfg.head_dim:
        # the load reorders q's and k's rows for partial rotary (`fill.checkpoint_layout`), which a quantized
        # checkpoint's packed values and scales do not take row by row
        raise ValueError(f"the quantized checkpoint {model_path!r} rotates {cfg.rope_dim} of its head_dim="
                         f"{cfg.head_dim} dims (partial rotary); tokenmill serves partial rotary from plain weights "
                         "only (--quantization fp8 quantizes them at load)")
    if quantization == "fp8" and cfg.quantization is None:
        cfg = dataclasses.replace(cfg, quantization=Fp8Config())
    if isinstance(cfg.quantization, Fp8Config):
        fp8.check_device(device)
    model = build_model(cfg, device, dtype, tp)
    if is_gguf(model_path):
        load_gguf_weights(model, model_path)
    else:
        load_weights(model, model_path)
    model.fold_multipliers()
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return model.eval()


def is_gguf(path: str) -> bool:
    return str(path).lower().endswith(".gguf") and os.path.isfile(path)


def check_quantization(requested: str | None, cfg: ModelConfig, model_path: str) -> None:
    """A requested quantization must be the checkpoint's own: tokenmill reads pre-quantized weights, and
    quantizes at load only to fp8, plain weights and a GGUF file's (each tensor dequantized as read) alike."""
    if requested is None:
        return
    if is_gguf(model_path):
        if requested == "fp8":
            return
        raise ValueError(f"--quantization {requested} cannot apply to {model_path!r}, a GGUF file: its own types "
                         "are dequantized as they are read, and fp8 is the one quantization a GGUF file can be "
                         "quantized to at load (--quantization fp8)")
    have = cfg.quantization.method if cfg.quantization is not None else None
    if have is None and requested == "fp8":
        return
    if have is None:
        raise ValueError(f"--quantization {requested} was asked for, but the checkpoint {model_path!r} has no "
                         "quantization_config (plain weights); tokenmill quantizes at load only to fp8")
    if have != QUANTIZATION_ALIASES.get(requested, requested):
        fmt = getattr(cfg.quantization, "checkpoint_format", None)
        raise ValueError(f"--quantization {requested} does not match the checkpoint {model_path!r}, which is "
                         f"{have}{f' ({fmt})' if fmt and fmt != have else ''} (its quantization_config); leave "
                         "--quantization unset to take the checkpoint's")
