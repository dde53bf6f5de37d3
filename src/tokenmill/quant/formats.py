"""The quantized checkpoint formats served: each `quantization_config` of a config.json checked and read
into the config of its layers (`W4Config`, `Fp8Config`), a ValueError naming any value not supported.
Without torch: an API server process reads model configs without the tensor library."""
from __future__ import annotations

import re
from dataclasses import dataclass

# the decoder's linear layers, by their checkpoint names; everything else stays in the model dtype
QUANTIZED_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
W4_METHODS = ("awq", "gptq")
W4_BITS = (4,)
W4_GROUP_SIZES = (32, 64, 128)
FP8_METHODS = ("fp8", "compressed-tensors")    # the quant_method values of FP8 checkpoints
FP8_BLOCKS = ((128, 128),)
# --quantization values: the checkpoint's format (fp8 also quantizes a plain checkpoint at load)
QUANTIZATION_METHODS = (*W4_METHODS, "fp8")
# vLLM's names of its Marlin kernels for the same AWQ and GPTQ checkpoints (vLLM picks them itself where it
# can, and users name them): each is its checkpoint format, run by tokenmill's own 4-bit kernels
QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}


def parse_quantization(qc: dict, unserved: tuple[str, ...] = ()) -> W4Config | Fp8Config:
    """A config.json's `quantization_config` -> the config of its layers. `unserved`: the name prefixes of a
    multimodal checkpoint's parts not served (`hf_config.TEXT_OF_MULTIMODAL`), which it may leave unquantized."""
    qc = _object(qc, "quantization_config")
    method = str(qc.get("quant_method", "")).lower()
    if method in FP8_METHODS:
        return parse_fp8_config(qc, unserved)
    if method not in W4_METHODS:
        raise ValueError(f"quantization_config quant_method {qc.get('quant_method')!r} is not supported; "
                         f"supported: {', '.join((*W4_METHODS, *FP8_METHODS))}")
    return parse_w4_config(qc, unserved)


def _object(value, what: str) -> dict:
    """`value`, a JSON object of a checkpoint's config; anything else is refused naming `what`."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {value!r}")
    return value


@dataclass(frozen=True)
class W4Config:
    """A checkpoint's `quantization_config`, checked: `zero_offset` is what readers add to a stored zero
    (1 for GPTQ v1, else 0); `desc_act`: GPTQ's act-order, whose `g_idx` every layer must then carry."""
    method: str
    group_size: int
    bits: int = 4
    sym: bool = False
    zero_offset: int = 0
    desc_act: bool = False

    def num_groups(self, in_features: int) -> int:
        return -(-in_features // self.group_size)


def parse_w4_config(qc: dict, unserved: tuple[str, ...] = ()) -> W4Config:
    """A config.json's `quantization_config` -> W4Config, or a ValueError naming the unsupported value."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in W4_METHODS:
        raise ValueError(f"quantization_config quant_method {qc.get('quant_method')!r} is not supported; "
                         f"supported: {', '.join(W4_METHODS)}")
    bits = qc.get("bits", qc.get("w_bit"))
    if type(bits) is not int or bits not in W4_BITS:
        raise ValueError(f"{method} checkpoint with bits={bits!r} is not supported; supported: 4")
    group = qc.get("group_size", qc.get("q_group_size"))
    if type(group) is not int or group not in W4_GROUP_SIZES:
        raise ValueError(f"{method} checkpoint with group_size={group!r} is not supported; supported: "
                         f"{', '.join(map(str, W4_GROUP_SIZES))}")
    if _not_the_head(qc.get("modules_to_not_convert"), unserved):
        raise ValueError(f"{method} checkpoint with modules_to_not_convert={qc['modules_to_not_convert']!r} "
                         "is not supported; supported: every decoder linear layer quantized (the head, and a "
                         "multimodal checkpoint's vision tower, may be left out)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq checkpoint with version={qc.get('version')!r} is not supported; "
                             "supported: gemm")
        if not qc.get("zero_point", True):
            raise ValueError("awq checkpoint with zero_point=false is not supported; supported: true")
        return W4Config("awq", group, bits)
    if qc.get("lm_head", False):
        raise ValueError("gptq checkpoint with lm_head=true (a quantized head) is not supported; "
                         "supported: lm_head=false")
    if str(qc.get("pack_dtype", "int32")).replace("torch.", "") != "int32":
        raise ValueError(f"gptq checkpoint with pack_dtype={qc['pack_dtype']!r} is not supported; supported: int32")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint with checkpoint_format={qc.get('checkpoint_format')!r} is not "
                         "supported; supported: gptq, gptq_v2")
    if qc.get("dynamic"):
        raise ValueError(f"gptq checkpoint with dynamic={qc['dynamic']!r} (per-module overrides) is not supported; "
                         "supported: one configuration for every layer")
    return W4Config("gptq", group, bits, sym=bool(qc.get("sym", True)), zero_offset=1 if fmt == "gptq" else 0,
                    desc_act=bool(qc.get("desc_act", False)))


@dataclass(frozen=True)
class Fp8Config:
    """FP8 weights. `weight_block_size` None: one scale per output channel; else (block_n, block_k).
    `checkpoint_format`: the quant_method they were stored as, or None when quantized at load."""
    weight_block_size: tuple[int, int] | None = None
    checkpoint_format: str | None = None
    method: str = "fp8"

    @property
    def scale_name(self) -> str:
        return "weight_scale" if self.weight_block_size is None else "weight_scale_inv"

    def block(self, in_features: int) -> tuple[int, int]:
        return (1, in_features) if self.weight_block_size is None else self.weight_block_size

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        bn, bk = self.block(in_features)
        return -(-out_features // bn), -(-in_features // bk)


def parse_fp8_config(qc: dict, unserved: tuple[str, ...] = ()) -> Fp8Config:
    """A config.json's FP8 `quantization_config` -> Fp8Config, or a ValueError naming the unsupported value."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoint with fmt={qc.get('fmt')!r} is not supported; supported: e4m3")
        scheme = str(qc.get("activation_scheme", "dynamic")).lower()
        if scheme != "dynamic":
            raise ValueError(f"fp8 checkpoint with activation_scheme={qc.get('activation_scheme')!r} is not "
                             "supported; supported: dynamic")
        block = qc.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or any(type(b) is not int for b in block)
                or tuple(block) not in FP8_BLOCKS):
            raise ValueError(f"fp8 checkpoint with weight_block_size={block!r} is not supported; supported: "
                             f"{', '.join(str(list(b)) for b in FP8_BLOCKS)}")
        _check_ignored(qc.get("modules_to_not_convert") or qc.get("ignored_layers"), "fp8", unserved)
        return Fp8Config(tuple(block), "fp8")
    if method != "compressed-tensors":
        raise ValueError(f"quant_method {qc.get('quant_method')!r} is not an FP8 format; supported: "
                         f"{', '.join(FP8_METHODS)}")
    fmt = qc.get("format", "dense")          # compressed-tensors' own default: weights stored unquantized
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors checkpoint with format={fmt!r} is not supported; supported: "
                         "float-quantized")
    if qc.get("kv_cache_scheme"):
        raise ValueError(f"compressed-tensors checkpoint with kv_cache_scheme={qc['kv_cache_scheme']!r} (stored KV "
                         "cache scales) is not supported; supported: none (--kv-cache-dtype fp8 sets its own)")
    groups = _object(qc.get("config_groups") or {}, "compressed-tensors config_groups")
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoint with {len(groups)} config_groups is not supported; "
                         "supported: one group for every Linear")
    (name, group), = groups.items()
    group = _object(group, f"compressed-tensors group {name!r}")
    targets = group.get("targets") or []
    if list(targets) != ["Linear"]:
        raise ValueError(f"compressed-tensors group {name!r} with targets={targets!r} is not supported; "
                         "supported: ['Linear']")
    w = _object(group.get("weights") or {}, "compressed-tensors weights")
    got = (w.get("num_bits"), str(w.get("type")).lower(), str(w.get("strategy")).lower())
    if got != (8, "float", "channel"):
        raise ValueError(f"compressed-tensors weights num_bits={w.get('num_bits')!r} type={w.get('type')!r} "
                         f"strategy={w.get('strategy')!r} are not supported; supported: num_bits=8 "
                         "type='float' strategy='channel'")
    if not w.get("symmetric", True) or w.get("dynamic", False):
        raise ValueError("compressed-tensors weights with symmetric=false or dynamic=true are not supported; "
                         "supported: static symmetric scales")
    act = group.get("input_activations")
    act = None if act is None else _object(act, "compressed-tensors input_activations")
    if act is not None and not act.get("dynamic", False):
        raise ValueError(f"compressed-tensors input_activations with dynamic=false (static scales, strategy="
                         f"{act.get('strategy')!r}) are not supported; supported: dynamic per-token or none")
    _check_ignored(qc.get("ignore"), "compressed-tensors", unserved)
    return Fp8Config(None, "compressed-tensors")


# a decoder linear layer's name in each form a checkpoint stores it: a text model's, and a multimodal one's
# language model's (`hf_config.TEXT_OF_MULTIMODAL`, older files' and transformers 5's)
_DECODER_LINEARS = tuple(f"{prefix}layers.0.{block}.{name}"
                         for prefix in ("model.", "language_model.model.", "model.language_model.")
                         for block, names in (("self_attn", QUANTIZED_LAYERS[:4]), ("mlp", QUANTIZED_LAYERS[4:]))
                         for name in names)


def _not_the_head(modules, unserved: tuple[str, ...] = ()) -> list[str]:
    """The entries of a checkpoint's list of unquantized modules other than the vocabulary head, which
    tokenmill always keeps in the model dtype, and the parts of a multimodal checkpoint not served (`unserved`
    prefixes: its vision tower, which llm-compressor leaves unquantized and lists layer by layer). An entry is
    a name (`lm_head`, a multimodal checkpoint's `language_model.lm_head`, `vision_tower` or a module under it),
    or a compressed-tensors `re:` pattern that matches the head or an unserved module and no decoder layer."""
    def head_only(m: str) -> bool:
        if not m.startswith("re:"):
            return m == "lm_head" or m.endswith(".lm_head") or any((m + ".").startswith(p) for p in unserved)
        pattern = re.compile(m[3:])
        if any(pattern.fullmatch(name) for name in _DECODER_LINEARS):
            return False
        return any(pattern.fullmatch(name) for name in ("lm_head", "language_model.lm_head",
                                                        *(p + "encoder.layers.0.mlp.fc1" for p in unserved)))
    return [m for m in modules or () if not head_only(str(m))]


def _check_ignored(modules, method: str, unserved: tuple[str, ...] = ()) -> None:
    rest = _not_the_head(modules, unserved)
    if rest:
        raise ValueError(f"{method} checkpoint leaving {rest[:4]!r} unquantized is not supported; "
                         "supported: every decoder linear layer in FP8 (the head, and a multimodal checkpoint's vision tower, "
                         "may be left out)")
