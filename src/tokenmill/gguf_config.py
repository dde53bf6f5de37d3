"""The one place that reads a GGUF file's model metadata (`ModelConfig.from_gguf`), into our `ModelConfig`:
its typed values, its RoPE scaling (linear, YaRN, Llama 3's rope_freqs tensor, phi3's LongRoPE factor
tensors) and the per-architecture keys."""
from __future__ import annotations

from typing import Any

from tokenmill.config_values import GRANITE_MULTIPLIERS, parse_dtype, positive, rope_all_but_every


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
    if positive(original):
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


def read_gguf_config(cls: type, gguf: Any):
    """`ModelConfig.from_gguf`'s reading: a GGUF file's metadata (a path, or an opened `gguf_file.GGUFFile`)
    as a `cls`."""
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
    rope_layers = rope_all_but_every(4, layers) if arch == "smollm3" else None
    file_type = _gguf_value(file, "general.file_type", int, None)
    dtype = parse_dtype({0: "float32", 1: "float16", 32: "bfloat16"}.get(file_type, "bfloat16"))
    # llama.cpp's phi3 writes 0 for no window; the window spans every layer, as in transformers' Phi3
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
