"""The one place that reads a Hugging Face config.json (`ModelConfig.from_hf`), into our `ModelConfig` as
transformers reads it: the per-architecture defaults, Phi-3's RoPE, SmolLM3's NoPE layers, Granite's
multipliers, a Gemma 3 multimodal checkpoint's text_config, Gemma 2's and Gemma 3's layers (`hf_gemma.py`), the
other architectures' sliding-window layers, and `merge_hf_overrides` (--hf-overrides)."""
from __future__ import annotations

import glob
import os
from typing import Any

from tokenmill.config_values import GRANITE_MULTIPLIERS, finite_number, parse_dtype, positive, rope_all_but_every
from tokenmill.generation_config import parse_eos_ids, read_json_object
from tokenmill.hf_gemma import GEMMA, GEMMA3, GEMMA_DEFAULTS, gemma3_rope, gemma_layers
from tokenmill.quant.formats import parse_quantization


def _sliding_window(arch: str, hf: dict[str, Any],
                    rope_layers: tuple[bool, ...] | None) -> tuple[int | None, tuple[bool, ...] | None]:
    """The sliding window of a Hugging Face config and the layers that attend over it (`ModelConfig.
    sliding_window`, `sliding_layers`; (None, None): none), as transformers' decoders apply them (the mask of
    eager and sdpa attention): Mistral and Phi-3 over every layer (`_EVERY_LAYER_WINDOW`; layer_types
    unread); Qwen2 and Qwen3 with use_sliding_window alone (its window of 4,096 by default), over the layers
    layer_types marks "sliding_attention", without it those from max_window_layers on (28 by default);
    SmolLM3 over the layers layer_types marks (its window whatever use_sliding_window says), without it its
    NoPE layers (`rope_layers`) when use_sliding_window is set; Llama and Granite nowhere (their decoders read
    no window key)."""
    if arch in _EVERY_LAYER_WINDOW:
        return _checked_window(hf.get("sliding_window")), None
    n = hf["num_hidden_layers"]
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
        first = hf["max_window_layers"] if hf.get("max_window_layers") is not None else 28
        default = [window is not None and i >= first for i in range(n)]
    elif arch == "SmolLM3ForCausalLM":
        window = hf.get("sliding_window")
        slides = bool(hf.get("use_sliding_window")) and window is not None
        default = [slides and not rotates for rotates in rope_layers]
    else:
        return None, None
    types = hf.get("layer_types")
    if types:
        if not isinstance(types, list) or len(types) != n:
            raise ValueError(f"config.json's layer_types is {types!r}; it must list each of the num_hidden_layers={n} "
                             "layers' attention (\"full_attention\" or \"sliding_attention\")")
        sliding = [t == "sliding_attention" for t in types]
    else:
        sliding = default
    if not any(sliding):
        return None, None
    if window is None:
        why = (f"{arch} has no window without use_sliding_window" if arch != "SmolLM3ForCausalLM"
               and not hf.get("use_sliding_window") else "sliding_window is null")
        raise ValueError(f"config.json's layer_types marks layers {[i for i, s in enumerate(sliding) if s][:8]} "
                         f"\"sliding_attention\", but {why}: transformers builds no mask for them either")
    return _checked_window(window), None if all(sliding) else tuple(sliding)


# the config.json keys read without a default
_REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# transformers' defaults for the keys a config.json may leave out, where an architecture's differ from the
# ones `from_hf` falls back on (Llama's)
_HF_DEFAULTS = {"SmolLM3ForCausalLM": {"rope_theta": 2e6, "tie_word_embeddings": True, "num_key_value_heads": 4,
                                       "max_position_embeddings": 32768},
                "GraniteForCausalLM": {"max_position_embeddings": 2048},
                # Phi3Config's original_max_position_embeddings (4,096) is always an attribute, which transformers
                # puts over the RoPE dict's own
                "Phi3ForCausalLM": {"rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096},
                "MistralForCausalLM": {"sliding_window": 4096, "max_position_embeddings": 131072},
                **GEMMA_DEFAULTS}

# multimodal checkpoints served as text alone (`models/registry.py`): the prefixes of their language model's tensors
# and what each stands for here (older files' and transformers 5's names alike), and the prefixes of the parts
# not served (vision tower, projector), whose tensors the load skips (`runner/loader.py`) and whose linear layers
# a quantized checkpoint may leave unquantized. Their config.json's text_config is the model's (`_text_config`)
TEXT_OF_MULTIMODAL: dict[str, tuple[tuple[tuple[str, str], ...], tuple[str, ...]]] = {
    "Gemma3ForConditionalGeneration": (
        (("language_model.model.", "model."), ("model.language_model.", "model."),
         ("language_model.lm_head.", "lm_head.")),
        ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")),
}

# the architectures whose sliding_window (when set) spans every layer
_EVERY_LAYER_WINDOW = ("Phi3ForCausalLM", "MistralForCausalLM")

# Phi-3's RoPE kinds as transformers' Phi3Config takes them: su and yarn are older names of longrope
_PHI3_ROPE_TYPES = {"default": "default", "longrope": "longrope", "su": "longrope", "yarn": "longrope"}

def _checked_window(window: Any) -> int | None:
    """config.json's sliding_window where a layer reads it (None: none)."""
    if window is not None and (type(window) is not int or window < 1):
        raise ValueError(f"config.json's sliding_window is {window!r}; it must be an integer >= 1 (or null: none)")
    return window


def _text_config(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """A multimodal config.json's language model as a text model's config: its text_config over the top level
    (which holds the architecture, dtype, EOS ids, quantization_config), the vision_config left out."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{arch}'s config.json has text_config {text!r}; its language model's config must be an "
                         "object there")
    return {**{k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}, **text,
            "architectures": hf["architectures"]}


def _phi3_rope(rope: dict[str, Any], hf: dict[str, Any], head_dim: int) -> tuple[str, int | None]:
    """Phi-3's RoPE kind and rotated dims of a head (None: all), as transformers' Phi3 reads them:
    partial_rotary_factor from the RoPE dict, else the top level (Phi-4-mini's 0.75), rotating int(head_dim x
    factor) dims."""
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in _PHI3_ROPE_TYPES:
        raise ValueError(f"Phi3ForCausalLM with rope_scaling of type {kind!r} is not supported: transformers' Phi3 "
                         "takes longrope (or su and yarn, its older names) or none")
    factor = rope.get("partial_rotary_factor")
    factor = hf.get("partial_rotary_factor", 1.0) if factor is None else factor
    if not (finite_number(factor) and 0 < factor <= 1):
        raise ValueError(f"config.json's partial_rotary_factor is {factor!r}; it must be a number in (0, 1], the "
                         "share of each head's dims that RoPE rotates")
    rotary = int(head_dim * factor)
    return _PHI3_ROPE_TYPES[kind], None if rotary == head_dim else rotary


def _no_rope_layers(hf: dict[str, Any]) -> tuple[bool, ...]:
    """SmolLM3's per-layer RoPE flags, as transformers reads them: `no_rope_layers` (1: the layer rotates q
    and k, 0: a NoPE layer; entries past the last layer unread), or without it every
    `no_rope_layer_interval`-th layer (4 by default) a NoPE layer."""
    n = hf["num_hidden_layers"]
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = hf.get("no_rope_layer_interval", 4)
        if type(interval) is not int or interval < 1:
            raise ValueError(f"config.json's no_rope_layer_interval is {interval!r}; it must be an integer >= 1 "
                             "(every interval-th layer applies no RoPE)")
        return rope_all_but_every(interval, n)
    if not isinstance(flags, list) or len(flags) < n or any(
            type(f) not in (int, bool) or f not in (0, 1) for f in flags[:n]):
        shown = (f"{flags[:8]}{'...' if len(flags) > 8 else ''} ({len(flags)} entries)" if isinstance(flags, list)
                 else repr(flags))
        raise ValueError(f"config.json's no_rope_layers is {shown}; it must list 1 (RoPE) or 0 (no RoPE) for each "
                         f"of the num_hidden_layers={n} layers")
    return tuple(bool(f) for f in flags[:n])


def merge_hf_overrides(hf: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json's dict with `overrides` (vLLM's --hf-overrides) over it, as a new dict: where both hold an
    object under a key the two are merged key by key, so {"rope_scaling": {"factor": 2.0}} changes one
    number of the checkpoint's rope_scaling; any other value (null included) replaces the checkpoint's."""
    merged = dict(hf)
    for key, value in overrides.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = merge_hf_overrides(merged[key], value) if both else value
    return merged


def read_hf_config(cls: type, hf: dict[str, Any] | str | os.PathLike,
                   hf_overrides: dict[str, Any] | None = None):
    """`ModelConfig.from_hf`'s reading: a Hugging Face config (a dict, a config.json path or a model
    directory), with `hf_overrides` merged over it first, as a `cls`."""
    if not isinstance(hf, dict):
        path = os.fspath(hf)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            ggufs = sorted(os.path.basename(g) for g in glob.glob(os.path.join(os.path.dirname(path), "*.gguf")))
            hint = f"; it holds {', '.join(ggufs[:4])}: a GGUF model is given as the file itself" if ggufs else ""
            raise FileNotFoundError(f"no config.json at {path}{hint}")
        hf = read_json_object(path)
        # older AutoGPTQ checkpoints keep their quantization in quantize_config.json beside it (vLLM
        # reads it too); quant_method is GPTQ's where it does not say
        legacy = os.path.join(os.path.dirname(path), "quantize_config.json")
        if not hf.get("quantization_config") and os.path.isfile(legacy):
            hf["quantization_config"] = {"quant_method": "gptq", **read_json_object(legacy)}
    if hf_overrides:
        hf = merge_hf_overrides(hf, hf_overrides)
    archs = hf.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; cannot choose a model class")
    arch = archs[0]
    if arch in TEXT_OF_MULTIMODAL:
        hf = _text_config(hf, arch)
    hf = {**_HF_DEFAULTS.get(arch, {}), **hf}
    missing = [k for k in _REQUIRED_HF_KEYS if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}; a decoder's config needs "
                         f"{', '.join(_REQUIRED_HF_KEYS)}")
    # SmolLM3 alone reads no_rope_layers (another architecture's config may carry it unread)
    layers = hf["num_hidden_layers"]
    rope_layers = (_no_rope_layers(hf) if arch == "SmolLM3ForCausalLM" and type(layers) is int and layers > 0
                   else None)
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    # Qwen3's head_dim is its own (transformers' default 128), not the hidden size over the heads
    head_dim = hf.get("head_dim") or (128 if arch == "Qwen3ForCausalLM" else hidden // heads)
    # transformers' reading: the RoPE dict (rope_scaling, or rope_parameters) before the top level, its
    # kind under "rope_type" or the older "type"; the scaled kinds' original context from the top level
    # first, else the dict's, else max_position_embeddings. Gemma 3's is its full-attention layers'
    gemma3 = arch in GEMMA3
    rope, local_rope_theta = (gemma3_rope(hf) if gemma3
                              else (dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {}), None))
    rope_theta = _as_float(next((v for v in (rope.get("rope_theta"), hf.get("rope_theta")) if v is not None),
                                10000.0))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    phi3 = arch == "Phi3ForCausalLM"
    rotary_dim = None
    if phi3:
        kind, rotary_dim = _phi3_rope(rope, hf, head_dim)
    scaling = None if kind == "default" else {**rope, "rope_type": kind}
    if scaling is not None and kind in ("llama3", "yarn", "longrope"):
        if hf.get("original_max_position_embeddings"):
            scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
    if kind in ("yarn", "longrope") and scaling.get("factor") is None:
        # transformers' YaRN and LongRoPE without a factor: the stretch from the original context to the
        # model's (LongRoPE's sets its attention factor alone)
        context, original = hf.get("max_position_embeddings", 4096), scaling["original_max_position_embeddings"]
        if positive(context) and positive(original):
            scaling["factor"] = context / original
    eos_ids = parse_eos_ids(hf.get("eos_token_id"), "config.json")
    dtype = parse_dtype(hf.get("dtype") or hf.get("torch_dtype"))
    gemma = arch in GEMMA
    act = hf["hidden_activation"] if gemma else hf.get("hidden_act", "silu")
    # transformers' Phi3 reads neither bias key (it has no bias)
    if hf.get("mlp_bias") and not phi3:
        raise ValueError(f"{arch} with mlp_bias is not supported: the MLP's products carry no bias here")
    if hf.get("attention_bias") and arch != "Qwen2ForCausalLM" and not phi3:
        raise ValueError(f"{arch} with attention_bias is not supported: it puts a bias on o_proj too, "
                         "which carries none here (Qwen2's bias on q/k/v alone is)")
    window, sliding_layers = (_sliding_window(arch, hf, rope_layers) if not gemma and type(layers) is int and layers > 0
                              else (None, None))
    return cls(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=_as_float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        max_position_embeddings=_as_int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2's q/k/v always carry a bias (transformers' Qwen2 reads no attention_bias key)
        attention_bias=arch == "Qwen2ForCausalLM" or (not phi3 and bool(hf.get("attention_bias", False))),
        qk_norm=arch == "Qwen3ForCausalLM" or gemma3,
        eos_token_ids=eos_ids,
        bos_token_id=hf.get("bos_token_id"),
        dtype=dtype,
        hidden_act="silu" if act == "swish" else act,       # the same function
        quantization=(parse_quantization(hf["quantization_config"], TEXT_OF_MULTIMODAL.get(arch, ((), ()))[1])
                      if hf.get("quantization_config") else None),
        rope_layers=rope_layers,
        rotary_dim=rotary_dim,
        local_rope_theta=local_rope_theta,
        **(gemma_layers(hf) if gemma else {"sliding_window": window, "sliding_layers": sliding_layers}),
        # Granite alone reads its scalars (transformers' default 1.0 for each, the softmax scale included)
        **({name: hf.get(name, 1.0) for name in GRANITE_MULTIPLIERS} if arch == "GraniteForCausalLM" else {}),
    )


def _as_float(value):
    """A JSON number as a float; anything else as it is, for `ModelConfig` to refuse by the field's name."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _as_int(value):
    """A JSON number of a whole value as an int; anything else as it is, for `ModelConfig` to refuse by the
    field's name (a null failed in int())."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
        return int(value)
    return value
