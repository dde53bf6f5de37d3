"""Frozen configs: `ModelConfig.from_hf` is the one place that reads a Hugging Face config.json, and
`ModelConfig.from_gguf` the one that reads a GGUF file's model metadata."""
from __future__ import annotations

import dataclasses
import glob
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.generation_config import parse_eos_ids, read_json_object
from tokenmill.layers.kernel_config import KernelConfig
from tokenmill.quant.formats import QUANTIZATION_ALIASES, QUANTIZATION_METHODS, Fp8Config, W4Config, parse_quantization

# torch is imported where a dtype or a device is made, not here: an API server process builds these
# configs (the command line's) without the tensor library, which would cost it ~1.5 s of CPU and ~180 MB

if TYPE_CHECKING:
    import torch

# dtype names -> torch's attribute
_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


DTYPE_CHOICES = ("auto", *_DTYPES)      # what --dtype takes

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def _sliding_layers(hf: dict[str, Any], rope_layers: tuple[bool, ...] | None) -> tuple[list[int], int | None]:
    """The layers of a Hugging Face config that attend over a sliding window, and the window: the layers
    `layer_types` marks "sliding_attention", or without it with `use_sliding_window`, as transformers reads
    them: SmolLM3's NoPE layers (`rope_layers` given; no default window), else (older Qwen2 configs) the
    layers from `max_window_layers` on (defaults: a window of 4,096, layers from 28 on). A window of null
    slides nowhere."""
    window = hf["sliding_window"] if "sliding_window" in hf else (None if rope_layers is not None else 4096)
    types = hf.get("layer_types")
    if types:
        return [i for i, t in enumerate(types) if t == "sliding_attention"], window
    if rope_layers is not None:
        slides = hf.get("use_sliding_window") and window is not None
        return [i for i, rotates in enumerate(rope_layers) if slides and not rotates], window
    if hf.get("use_sliding_window") and window:
        first = hf["max_window_layers"] if hf.get("max_window_layers") is not None else 28
        return list(range(first, hf["num_hidden_layers"])), window
    return [], window


# the config.json keys read without a default
_REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# transformers' defaults for the keys a config.json may leave out, where an architecture's differ from the
# ones `from_hf` falls back on (Llama's)
_HF_DEFAULTS = {"SmolLM3ForCausalLM": {"rope_theta": 2e6, "tie_word_embeddings": True, "num_key_value_heads": 4,
                                       "max_position_embeddings": 32768},
                "GraniteForCausalLM": {"max_position_embeddings": 2048},
                # Phi3Config's original_max_position_embeddings (4,096) is always an attribute, which transformers
                # puts over the RoPE dict's own
                "Phi3ForCausalLM": {"rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096}}

# Phi-3's RoPE kinds as transformers' Phi3Config takes them: su and yarn are older names of longrope
_PHI3_ROPE_TYPES = {"default": "default", "longrope": "longrope", "su": "longrope", "yarn": "longrope"}

# Granite's four scalars, as config.json names them (transformers' default for each is 1.0, the attention's
# softmax scale included), and the GGUF keys llama.cpp's converter writes them under (where a key is left
# out, or 0, llama.cpp takes the neutral value: 1, and for the attention 1/sqrt(head_dim))
GRANITE_MULTIPLIERS = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                       "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}


def _phi3_rope(rope: dict[str, Any], hf: dict[str, Any], head_dim: int) -> tuple[str, int | None, int | None]:
    """Phi-3's RoPE kind, rotated dims of a head (None: all) and sliding window (None: none), as transformers'
    Phi3 reads them: partial_rotary_factor from the RoPE dict, else the top level (Phi-4-mini's 0.75), rotating
    int(head_dim x factor) dims; the window over every layer."""
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in _PHI3_ROPE_TYPES:
        raise ValueError(f"Phi3ForCausalLM with rope_scaling of type {kind!r} is not supported: transformers' Phi3 "
                         "takes longrope (or su and yarn, its older names) or none")
    factor = rope.get("partial_rotary_factor")
    factor = hf.get("partial_rotary_factor", 1.0) if factor is None else factor
    if not (finite_number(factor) and 0 < factor <= 1):
        raise ValueError(f"config.json's partial_rotary_factor is {factor!r}; it must be a number in (0, 1], the "
                         "share of each head's dims that RoPE rotates")
    window = hf.get("sliding_window")
    if window is not None and (type(window) is not int or window < 1):
        raise ValueError(f"config.json's sliding_window is {window!r}; it must be an integer >= 1 (or null: none)")
    rotary = int(head_dim * factor)
    return _PHI3_ROPE_TYPES[kind], None if rotary == head_dim else rotary, window


def _rope_all_but_every(interval: int, layers: int) -> tuple[bool, ...]:
    """Per layer, whether it rotates: all but every `interval`-th (layers interval - 1, 2 interval - 1, ...)."""
    return tuple((i + 1) % interval != 0 for i in range(layers))


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
        return _rope_all_but_every(interval, n)
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


def finite_number(value: Any) -> bool:
    """A JSON number of a config (not a boolean, NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> bool:
    return finite_number(value) and value > 0


def _rope_freq_factors(file: Any, head_dim: int) -> tuple[float, ...]:
    """A GGUF file's `rope_freqs.weight`: the divisor of each rotary frequency (llama.cpp's converter writes
    it for Llama 3.1/3.2's llama3 scaling, inv_freq / scaled inv_freq), head_dim / 2 positive numbers."""
    t = file.tensors["rope_freqs.weight"]
    if tuple(t.shape) != (head_dim // 2,):
        raise ValueError(f"GGUF file {file.path!r} has rope_freqs.weight of shape {tuple(reversed(t.shape))}; "
                         f"it must hold one divisor per rotary frequency, {head_dim // 2} for head_dim {head_dim}")
    factors = file.read("rope_freqs.weight").double()
    if not bool(factors.isfinite().all() and (factors > 0).all()):
        raise ValueError(f"GGUF file {file.path!r} has rope_freqs.weight values that are not positive and "
                         f"finite ({factors.tolist()[:8]}...)")
    return tuple(factors.tolist())


_REQUIRED = object()
_VALUE_KINDS = {bool: "a bool", int: "an integer", float: "a float", str: "a string", list: "an array"}


def _gguf_value(file: Any, key: str, kind: type, default: Any = _REQUIRED) -> Any:
    """The GGUF metadata value `key` read as `kind` (int, float or str), `default` where the file lacks it.
    GGUF types its values, so one of another type (a number stored as a string, an array such as a
    per-layer value where one value belongs, a bool for a count) is refused, naming the key, the value and
    its type and what was expected, never coerced; only an integer reads as a float."""
    if key not in file.metadata:
        if default is _REQUIRED:
            raise ValueError(f"GGUF file {file.path!r} lacks metadata key {key}")
        return default
    value = file.metadata[key]
    if type(value) is not kind and not (kind is float and type(value) is int):
        shown = f"{value[:4]}{'...' if len(value) > 4 else ''}" if isinstance(value, list) else repr(value)
        raise ValueError(f"GGUF file {file.path!r} has metadata {key} = {shown}, "
                         f"{_VALUE_KINDS.get(type(value), type(value).__name__)}; "
                         f"tokenmill expects one value there, {_VALUE_KINDS[kind]}")
    return kind(value)


# GGUF YaRN keys (llama.cpp's converter writes them from config.json's rope_scaling) -> that dict's keys
_GGUF_YARN = {"rope.scaling.factor": "factor",
              "rope.scaling.original_context_length": "original_max_position_embeddings",
              "rope.scaling.yarn_beta_fast": "beta_fast", "rope.scaling.yarn_beta_slow": "beta_slow",
              "rope.scaling.yarn_attn_factor": "attention_factor"}
# llama.cpp's YaRN keys with no equal in transformers' YaRN, and the value each has when it changes nothing
_GGUF_YARN_NEUTRAL = {"rope.scaling.yarn_ext_factor": 1.0, "rope.scaling.yarn_log_multiplier": 0.0,
                      "rope.scaling.attn_factor": 1.0}


# the tensors in which llama.cpp's converter stores LongRoPE's short and long factors (phi3), read into the config
GGUF_LONGROPE = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}


def _gguf_longrope(file: Any, arch: str, rotary_dim: int) -> dict[str, Any]:
    """A GGUF file's LongRoPE as config.json's rope_scaling dict: the factors from their tensors (rotary_dim / 2
    each; checked by the RoPE table), the original context from rope.scaling.original_context_length and the
    attention factor from rope.scaling.attn_factor, which llama.cpp's converter computes as transformers does
    (where it is left out, from context_length over the original context, as transformers derives it)."""
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for name, key in GGUF_LONGROPE.items():
        if name not in file.tensors:
            raise ValueError(f"GGUF file {file.path!r} carries {' or '.join(n for n in GGUF_LONGROPE if n != name)} "
                             f"but not {name}; LongRoPE needs both sets of factors")
        t = file.tensors[name]
        if tuple(t.shape) != (rotary_dim // 2,):
            raise ValueError(f"GGUF file {file.path!r} has {name} of shape {tuple(reversed(t.shape))}; it must hold "
                             f"one factor per rotary frequency, {rotary_dim // 2} for {rotary_dim} rotated dims")
        scaling[key] = file.read(name).double().tolist()
    original = _gguf_value(file, f"{arch}.rope.scaling.original_context_length", int, None)
    if original is None:
        raise ValueError(f"GGUF file {file.path!r} has LongRoPE factors but lacks "
                         f"{arch}.rope.scaling.original_context_length, which chooses between them")
    scaling["original_max_position_embeddings"] = original
    context = _gguf_value(file, f"{arch}.context_length", int)
    if _positive(original):
        scaling["factor"] = context / original
    attn = _gguf_value(file, f"{arch}.rope.scaling.attn_factor", float, None)
    if attn is not None:
        scaling["attention_factor"] = attn
    return scaling


def _gguf_yarn(file: Any, arch: str) -> dict[str, Any]:
    """A GGUF file's YaRN scaling as config.json's rope_scaling dict: factor and original context are
    required (there is no max_position_embeddings of the original model to derive them from); a key of
    llama.cpp's own is taken only at the value that leaves transformers' YaRN unchanged."""
    for key, neutral in _GGUF_YARN_NEUTRAL.items():
        value = _gguf_value(file, f"{arch}.{key}", float, neutral)
        if value != neutral:
            raise ValueError(f"GGUF file {file.path!r} has {arch}.{key}={value}; tokenmill's YaRN (transformers') "
                             f"has no such setting and reads it only at {neutral}")
    scaling = {"rope_type": "yarn"}
    for key, name in _GGUF_YARN.items():
        required = name in ("factor", "original_max_position_embeddings")
        value = _gguf_value(file, f"{arch}.{key}", int if name == "original_max_position_embeddings" else float, None)
        if value is None and required:
            raise ValueError(f"GGUF file {file.path!r} has {arch}.rope.scaling.type='yarn' but lacks {arch}.{key}, "
                             f"which YaRN needs ({name})")
        if value is not None:
            scaling[name] = value
    return scaling


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype:
    """A dtype or its name -> the dtype; None -> float32."""
    import torch
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    key = str(value).replace("torch.", "").lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {value!r}; expected one of {sorted(set(_DTYPES))}")
    return getattr(torch, _DTYPES[key])


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype
    hidden_act: str = "silu"
    # the checkpoint's weight format (its quantization_config); None: plain weights
    quantization: W4Config | Fp8Config | None = None
    # per layer, whether it rotates q and k (`rotates`); None: every layer does. SmolLM3's NoPE layers do not
    rope_layers: tuple[bool, ...] | None = None
    # Granite's scalars: the embeddings times embedding_multiplier, each residual branch (attention and MLP
    # outputs) times residual_multiplier, the logits over logits_scaling, all three folded into the weights
    # at load (`LlamaForCausalLM.fold_multipliers`); the attention's softmax scale `attention_scale`
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # the softmax scale of q.k; None: 1/sqrt(head_dim)
    attention_multiplier: float | None = None
    # the leading dims of each head that RoPE rotates (Phi-3's partial_rotary_factor: Phi-4-mini's 96 of 128),
    # the rest passed through; None: the whole head
    rotary_dim: int | None = None
    # every layer attends over the latest sliding_window positions alone (Phi-3's). tokenmill attends over the
    # whole context, which is the same for a sequence no longer than the window: max_model_len is bounded by it
    sliding_window: int | None = None
    # the longest context served: the engine's max_model_len, set once resolved (`serving`); None:
    # derived_max_model_len. LongRoPE's factors are chosen by it (`rotary.longrope_uses_long_factors`)
    max_model_len: int | None = None

    def __post_init__(self):
        # sizes a checkpoint's config states: a zero or negative one failed deep in the build (an empty RoPE
        # table, a division by zero), or loaded a model whose KV heads no query head maps onto
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"the model config's {name} is {value!r}; it must be an integer >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"the model config's num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads} (each KV head serves a whole "
                             "group of query heads)")
        if self.head_dim % 2:
            raise ValueError(f"the model config's head_dim is {self.head_dim}; RoPE rotates a head's values in pairs, "
                             "so it must be even")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_hidden_layers:
            raise ValueError(f"the model config's rope_layers has {len(self.rope_layers)} entries; it needs one per "
                             f"layer, num_hidden_layers={self.num_hidden_layers}")
        for name in GRANITE_MULTIPLIERS:
            value = getattr(self, name)
            if not (name == "attention_multiplier" and value is None) and not _positive(value):
                raise ValueError(f"the model config's {name} is {value!r}; it must be a positive finite number")
        r = self.rotary_dim
        if r is not None and (type(r) is not int or r % 2 or not 2 <= r <= self.head_dim):
            raise ValueError(f"the model config's rotary_dim is {r!r}; RoPE rotates a head's leading dims in pairs, "
                             f"so it must be an even integer from 2 to head_dim={self.head_dim}")
        for name in ("sliding_window", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"the model config's {name} is {value!r}; it must be an integer >= 1 (or None)")
        # checked once the context is known (`serving`): a config is read before max_model_len is
        n, w = self.max_model_len, self.sliding_window
        if w is not None and n is not None and n > w:
            default = f" (the model's {self.derived_max_model_len_source})" if n == self.derived_max_model_len else ""
            raise ValueError(f"max_model_len={n}{default} is longer than the model's sliding_window={w}: its layers "
                             f"attend over the latest {w} positions alone, and tokenmill, which has no "
                             f"sliding-window attention, over the whole context, the same only up to {w} tokens; "
                             f"serve at most {w} (--max-model-len {w})")

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax, in every attention path (`PagedAttention.scale`)."""
        return self.head_dim ** -0.5 if self.attention_multiplier is None else float(self.attention_multiplier)

    @property
    def multiplies_weights(self) -> bool:
        """Whether loading scales weights by the config's multipliers (`LlamaForCausalLM.fold_multipliers`):
        its linear, embedding and norm weights are then not the checkpoint's."""
        return (self.embedding_multiplier, self.residual_multiplier, self.logits_scaling) != (1.0, 1.0, 1.0)

    @property
    def rope_dim(self) -> int:
        """The leading dims of each head that RoPE rotates: rotary_dim, else all of head_dim."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def served_max_model_len(self) -> int:
        """The longest context served: max_model_len once the engine set it, else derived_max_model_len."""
        return self.derived_max_model_len if self.max_model_len is None else self.max_model_len

    def serving(self, max_model_len: int) -> "ModelConfig":
        """This config serving contexts of up to `max_model_len` tokens (the engine's, once resolved): a
        sliding window shorter than it is refused here."""
        return dataclasses.replace(self, max_model_len=max_model_len)

    def rotates(self, layer: int) -> bool:
        """Whether `layer` applies RoPE to q and k (a NoPE layer attends by content alone)."""
        return self.rope_layers is None or self.rope_layers[layer]

    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | os.PathLike,
                hf_overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """Normalise a Hugging Face config (a dict, a config.json path or a model directory), with
        `hf_overrides` merged over it first (`merge_hf_overrides`)."""
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
        missing = [k for k in _REQUIRED_HF_KEYS if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}; a decoder's config needs "
                             f"{', '.join(_REQUIRED_HF_KEYS)}")
        arch = archs[0]
        hf = {**_HF_DEFAULTS.get(arch, {}), **hf}
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
        # first, else the dict's, else max_position_embeddings
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        rope_theta = float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)
        kind = rope.get("rope_type") or rope.get("type") or "default"
        phi3 = arch == "Phi3ForCausalLM"
        rotary_dim = window = None
        if phi3:
            kind, rotary_dim, window = _phi3_rope(rope, hf, head_dim)
        scaling = None if kind == "default" else {**rope, "rope_type": kind}
        if scaling is not None and kind in ("llama3", "yarn", "longrope"):
            if hf.get("original_max_position_embeddings"):
                scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
            scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
        if kind in ("yarn", "longrope") and scaling.get("factor") is None:
            # transformers' YaRN and LongRoPE without a factor: the stretch from the original context to the
            # model's (LongRoPE's sets its attention factor alone)
            context, original = hf.get("max_position_embeddings", 4096), scaling["original_max_position_embeddings"]
            if _positive(context) and _positive(original):
                scaling["factor"] = context / original
        eos_ids = parse_eos_ids(hf.get("eos_token_id"), "config.json")
        dtype = parse_dtype(hf.get("dtype") or hf.get("torch_dtype"))
        act = hf.get("hidden_act", "silu")
        # transformers' Phi3 reads neither bias key (it has no bias), nor the other architectures' window keys
        if hf.get("mlp_bias") and not phi3:
            raise ValueError(f"{arch} with mlp_bias is not supported: the MLP's products carry no bias here")
        if hf.get("attention_bias") and arch != "Qwen2ForCausalLM" and not phi3:
            raise ValueError(f"{arch} with attention_bias is not supported: it puts a bias on o_proj too, "
                             "which carries none here (Qwen2's bias on q/k/v alone is)")
        sliding, sliding_window = _sliding_layers(hf, rope_layers) if not phi3 else ([], None)
        if sliding:
            raise ValueError(f"{arch} with sliding-window attention in layers {sliding[:8]}"
                             f"{'...' if len(sliding) > 8 else ''} (sliding_window {sliding_window}) is "
                             "not supported: tokenmill attends over the whole context in every layer, which "
                             "changes the output past the window")
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v always carry a bias (transformers' Qwen2 reads no attention_bias key)
            attention_bias=arch == "Qwen2ForCausalLM" or (not phi3 and bool(hf.get("attention_bias", False))),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            dtype=dtype,
            hidden_act="silu" if act == "swish" else act,       # the same function
            quantization=(parse_quantization(hf["quantization_config"])
                          if hf.get("quantization_config") else None),
            rope_layers=rope_layers,
            rotary_dim=rotary_dim,
            sliding_window=window,
            # Granite alone reads its scalars (transformers' default 1.0 for each, the softmax scale included)
            **({name: hf.get(name, 1.0) for name in GRANITE_MULTIPLIERS} if arch == "GraniteForCausalLM" else {}),
        )

    @classmethod
    def from_gguf(cls, gguf: Any) -> "ModelConfig":
        """Our config from a GGUF file's metadata (a path, or an opened `gguf_file.GGUFFile`):
        `{arch}.*` shape keys, RoPE base, RMSNorm eps, context length, the tokenizer's BOS id and its
        EOS/EOT/EOM ids as stop ids, a head tied to the embedding when the file has no `output.weight`, a
        granite file's scalars, and a phi3 file's rotated dims, LongRoPE factors and sliding window."""
        from tokenmill.gguf_file import GGUF_ARCHITECTURES, GGUFFile, open_gguf

        file = gguf if isinstance(gguf, GGUFFile) else open_gguf(gguf)
        md, arch = file.metadata, file.architecture

        def get(key: str, kind: type, default: Any = _REQUIRED) -> Any:
            return _gguf_value(file, f"{arch}.{key}", kind, default)

        hidden, heads = get("embedding_length", int), get("attention.head_count", int)
        if hidden <= 0 or heads <= 0:
            raise ValueError(f"GGUF file {file.path!r} has {arch}.embedding_length={hidden} and "
                             f"{arch}.attention.head_count={heads}; both must be positive")
        head_dim = get("attention.key_length", int, hidden // heads)
        if get("attention.value_length", int, head_dim) != head_dim:
            raise ValueError(f"GGUF {arch}.attention.value_length differs from key_length={head_dim}")
        rotary = get("rope.dimension_count", int, head_dim)
        if rotary != head_dim and arch != "phi3":
            raise ValueError(f"GGUF {arch}.rope.dimension_count={rotary} rotates part of head_dim={head_dim}; "
                             "tokenmill rotates part of a head in phi3 files only (their rotate-half layout)")
        scaling_type = get("rope.scaling.type", str, "none")
        if scaling_type == "linear":
            scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor", float)}
        elif scaling_type == "yarn":
            scaling = _gguf_yarn(file, arch)
        elif scaling_type == "none":
            scaling = None
        else:
            raise ValueError(f"GGUF {arch}.rope.scaling.type={scaling_type!r} is not supported; "
                             "supported: none, linear, yarn")
        if "rope_freqs.weight" in file.tensors:
            if scaling is not None:
                raise ValueError(f"GGUF file {file.path!r} carries rope_freqs.weight and "
                                 f"{arch}.rope.scaling.type={scaling_type!r}; tokenmill reads one RoPE scaling")
            scaling = {"rope_type": "freq_factors", "freq_factors": _rope_freq_factors(file, head_dim)}
        if any(name in file.tensors for name in GGUF_LONGROPE):
            if scaling is not None:
                raise ValueError(f"GGUF file {file.path!r} carries {' and '.join(GGUF_LONGROPE)} beside another RoPE "
                                 "scaling; tokenmill reads one RoPE scaling")
            scaling = _gguf_longrope(file, arch, rotary)
        vocab = get("vocab_size", int, 0) or len(md.get("tokenizer.ggml.tokens") or ())
        if not vocab:
            vocab = int(file.tensors["token_embd.weight"].shape[1])
        # every end of generation the file names stops it, as in llama.cpp: EOS, a turn's end (EOT, Llama 3's
        # <|eot_id|>) and the end of a turn that called a tool (EOM, Llama 3.1's <|eom_id|>)
        eos = [_gguf_value(file, f"tokenizer.ggml.{kind}_token_id", int, None) for kind in ("eos", "eot", "eom")]
        layers = get("block_count", int)
        # llama.cpp's smollm3 leaves RoPE out of every 4th layer, a step it fixes in code (no metadata key)
        rope_layers = _rope_all_but_every(4, layers) if arch == "smollm3" else None
        file_type = _gguf_value(file, "general.file_type", int, None)
        dtype = parse_dtype({0: "float32", 1: "float16", 32: "bfloat16"}.get(file_type, "bfloat16"))
        # llama.cpp's phi3 writes 0 for no window
        window = (get("attention.sliding_window", int, 0) or None) if arch == "phi3" else None
        multipliers = {}
        if arch == "granite":
            if not get("rope.scaling.finetuned", bool, True):
                raise ValueError(f"GGUF file {file.path!r} has granite.rope.scaling.finetuned=false, which "
                                 "llama.cpp reads as no RoPE in any layer; tokenmill's granite rotates q and k")
            # 0, as llama.cpp reads it, and a key left out (its converter writes those config.json has) change
            # nothing
            multipliers = {name: value for name, key in GRANITE_MULTIPLIERS.items() if (value := get(key, float, 0.0))}
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length", int),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=get("attention.head_count_kv", int, heads),
            head_dim=head_dim,
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", float),
            rope_theta=get("rope.freq_base", float, 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=get("context_length", int),
            tie_word_embeddings="output.weight" not in file.tensors,
            attention_bias="blk.0.attn_q.bias" in file.tensors,
            qk_norm=arch == "qwen3",
            eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
            bos_token_id=_gguf_value(file, "tokenizer.ggml.bos_token_id", int, None),
            dtype=dtype,
            rope_layers=rope_layers,
            rotary_dim=None if rotary == head_dim else rotary,
            sliding_window=window,
            **multipliers,
        )

    @property
    def derived_max_model_len(self) -> int:
        """The longest context the model serves (vLLM's derived max_model_len; the RoPE table covers it):
        max_position_embeddings, or with YaRN original_max_position_embeddings x factor where that is
        longer. YaRN numbers that are not positive are left to the RoPE table's check, which names them."""
        s = self.rope_scaling
        if s is None or s["rope_type"] != "yarn" or not (_positive(s.get("factor"))
                                                         and _positive(s.get("original_max_position_embeddings"))):
            return self.max_position_embeddings
        return max(self.max_position_embeddings, int(s["original_max_position_embeddings"] * s["factor"]))

    @property
    def derived_max_model_len_source(self) -> str:
        """Where `derived_max_model_len` comes from, for an error that refuses a longer max_model_len."""
        n, s = self.derived_max_model_len, self.rope_scaling
        if n == self.max_position_embeddings:
            return f"max_position_embeddings={n}"
        return (f"YaRN context of {n} tokens (rope_scaling's original_max_position_embeddings="
                f"{s['original_max_position_embeddings']} x factor={s['factor']}; max_position_embeddings="
                f"{self.max_position_embeddings})")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * self.dtype.itemsize


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    # the checkpoint's weight format, as vLLM's --quantization: None takes the checkpoint's
    # (quantization_config in config.json); "awq" / "gptq" / "fp8" must match it (vLLM's "awq_marlin" /
    # "gptq_marlin" are "awq" / "gptq"), and "fp8" on a plain
    # checkpoint quantizes its linear layers at load (quant/fp8.py)
    quantization: str | None = None
    # the KV cache's element type, as vLLM's --kv-cache-dtype: "auto" (the model dtype) or "fp8" (alias
    # "fp8_e4m3": E4M3 with per-layer scales, layers/attention.py)
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    scheduling_policy: str = "fcfs"
    # --scheduling-policy priority ranks by priority - boosts - aging x seconds since arrival (lower first)
    priority_aging_per_second: float = 1.0
    priority_tool_boost: float = 5.0
    priority_short_boost: float = 2.0
    priority_short_max_tokens: int = 100
    # new prompts may wait this many times the last step's time to join a bigger prefill (0: off)
    scheduler_delay_factor: float = 0.0
    # cap each step's shape so that its time stays under this many milliseconds (None: off)
    target_itl_ms: float | None = None
    # GiB of host memory for KV blocks of swapped-out requests (pinned when the KV cache is on CUDA)
    swap_space: float = 4.0
    # how a request gives up its blocks: "swap" (to the swap space, recompute when it is full) or
    # "recompute"; None: swap when swap_space > 0, else recompute
    preemption_mode: str | None = None
    seed: int = 0
    enforce_eager: bool = False
    # steps with prefill tokens run as CUDA graphs up to this many tokens (0: only decode graphs)
    cuda_graph_max_tokens: int = 2048
    tokenizer: str | None = None
    # merged over the checkpoint's config.json before it is read, as vLLM's --hf-overrides
    # (`merge_hf_overrides`), e.g. {"rope_scaling": {"rope_type": "yarn", ...}}
    hf_overrides: dict | None = None
    extra: dict = field(default_factory=dict)
    # tiles and block sizes of the CUDA kernels (layers/kernel_config.py); the default is the shipped table
    kernels: KernelConfig = field(default_factory=KernelConfig)
    # ranks (one process each) that split every layer, as vLLM's --tensor-parallel-size
    # (runner/tensor_parallel.py); 1: one process, no process group
    tensor_parallel_size: int = 1

    def __post_init__(self):
        if self.quantization is not None and self.quantization not in (*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES):
            raise ValueError(f"quantization {self.quantization!r} is not supported; supported: "
                             f"{', '.join(QUANTIZATION_METHODS)} (or None: the checkpoint's own; vLLM's "
                             f"{' and '.join(QUANTIZATION_ALIASES)} are awq and gptq)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; supported: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not isinstance(self.seed, int) or not -2 ** 63 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be a 64-bit integer (in [-2**63, 2**63)), got {self.seed}")
        if self.tokenizer is not None:
            from tokenmill.engine.tokenizer import Tokenizer
            if not os.path.exists(self.tokenizer) or not Tokenizer.available(self.tokenizer):
                raise ValueError(f"tokenizer {self.tokenizer!r} holds no tokenizer (tokenizer.json, "
                                 "tokenizer_config.json, vocab.json, tokenizer.model, or a .gguf with one)")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict merged over config.json (None: none), got "
                             f"{type(self.hf_overrides).__name__} {self.hf_overrides!r}")
        if self.hf_overrides and self.model.lower().endswith(".gguf"):
            raise ValueError(f"hf_overrides edit a checkpoint's config.json; the GGUF model {self.model!r} has none "
                             "(its config is its metadata)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (or None: the model's), got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if not 0.0 < self.priority_aging_per_second < math.inf:
            raise ValueError(f"priority_aging_per_second must be > 0 and finite (with 0, a stream of better-ranked "
                             f"requests could starve one forever), got {self.priority_aging_per_second}")
        for name in ("priority_tool_boost", "priority_short_boost", "scheduler_delay_factor"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be >= 0 and finite, got {getattr(self, name)}")
        if self.priority_short_max_tokens < 0:
            raise ValueError(f"priority_short_max_tokens must be >= 0, got {self.priority_short_max_tokens}")
        if self.target_itl_ms is not None and not 0.0 < self.target_itl_ms < math.inf:
            raise ValueError(f"target_itl_ms must be > 0 and finite (or None: off), got {self.target_itl_ms}")
        if not 0.0 <= self.swap_space < math.inf:
            raise ValueError(f"swap_space must be >= 0 GiB and finite, got {self.swap_space}")
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
        if self.swap_space > 0.7 * host:
            # vLLM's bound: the swap space is pinned host memory, the rest of the machine needs the rest
            raise ValueError(f"swap_space {self.swap_space:g} GiB is more than 70% of this machine's "
                             f"{host:.1f} GiB of memory ({0.7 * host:.1f} GiB)")
        if self.preemption_mode not in (None, "swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode 'swap' needs swap space: set swap_space > 0 GiB")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cuda_graph_max_tokens < 0:
            raise ValueError(f"cuda_graph_max_tokens must be >= 0, got {self.cuda_graph_max_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.preemption_mode == "swap":
            raise ValueError(f"preemption_mode 'swap' is not supported with tensor_parallel_size="
                             f"{self.tensor_parallel_size} (each rank would have to swap its own KV heads); "
                             "preempted requests recompute")

    def check_tensor_parallel(self, model: ModelConfig, device: torch.device) -> None:
        """Refuses a tensor_parallel_size that does not split the model evenly, or a device whose
        multi-process path is not built."""
        n = self.tensor_parallel_size
        if n == 1:
            return
        if device.type != "cpu":
            raise ValueError(f"tensor_parallel_size={n} runs on the CPU only (gloo process group); the "
                             f"{device.type} path (NCCL, all-reduces inside CUDA graphs) is not implemented")
        for name in ("num_key_value_heads", "num_attention_heads", "intermediate_size", "vocab_size"):
            if getattr(model, name) % n:
                raise ValueError(f"tensor_parallel_size={n} must divide the model's {name}="
                                 f"{getattr(model, name)} (each rank holds an equal share)")

    def resolve_device(self) -> torch.device:
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device {self.device!r} is not a device: auto, cpu, cuda or cuda:N") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: this machine's torch sees no CUDA device")
        return device

    def resolve_dtype(self, model_config: ModelConfig, device: torch.device) -> torch.dtype:
        import torch
        if self.dtype != "auto":
            return parse_dtype(self.dtype)
        if device.type == "cpu":
            return torch.float32
        return model_config.dtype if model_config.dtype != torch.float32 else torch.bfloat16

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        import torch
        return model_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn


def priority_refusal(priority: int, policy: str) -> str | None:
    """Why a request of `priority` is refused under the scheduling `policy` (None: it is not): a priority is
    honoured only by the priority policy, and one the scheduler would ignore is refused rather than dropped. The
    engine refuses it, and a frontend that knows the core's policy (`CoreReady`) refuses it before answering."""
    if priority and policy != "priority":
        return (f"priority {priority} is only honoured under the priority scheduling policy (--scheduling-policy "
                f"priority); this engine's is {policy!r}")
    return None
