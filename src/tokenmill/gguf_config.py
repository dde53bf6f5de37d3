"""The one place that reads a GGUF file's model metadata (`ModelConfig.from_gguf`), into our `ModelConfig`:
its typed values, its RoPE scaling (linear, YaRN, Llama 3's rope_freqs tensor, phi3's LongRoPE factor
tensors) and the per-architecture keys (granite's scalars, phi3's window, gemma2's and gemma3's layers)."""
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


# llama.cpp's Gemma files hold no query_pre_attn_scalar: llama.cpp scales q.k by 1/sqrt(hidden / heads) in the 27B
# models, which it tells apart by their layer count, and by 1/sqrt(head_dim) in the others, as their checkpoints'
# query_pre_attn_scalar does (144 and 168 for Gemma 2's and Gemma 3's 27B; head_dim, 256, for every other size)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# what llama.cpp takes where a Gemma file leaves a key out: every pattern-th layer attends to the whole context
# (Gemma 2's every other one, Gemma 3's every 6th), Gemma 2's window and soft caps (transformers' Gemma2Config
# defaults too), and Gemma 3's sliding layers' RoPE base (its rope_local_base_freq)
_GEMMA_DEFAULTS = {"gemma2": dict(pattern=2, window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
                   "gemma3": dict(pattern=6, window=0, attn_logit_softcapping=None, final_logit_softcapping=None,
                                  local_rope_theta=10000.0)}


def _gguf_gemma(file: Any, arch: str, layers: int, hidden: int, heads: int, head_dim: int,
                rope_theta: float) -> dict[str, Any]:
    """A gemma2 or gemma3 file's features as `ModelConfig` fields, its keys read as llama.cpp reads them and the
    model computed as transformers' Gemma2 and Gemma3 compute the checkpoint it was converted from (as
    `hf_gemma.gemma_layers` reads its config.json): four norms a layer, GELU tanh, the embeddings times
    sqrt(hidden_size) rounded to the dtype, the soft caps, q/k norm (gemma3), and the sliding layers:
    `attention.sliding_window_pattern` (a period n: each n-th layer attends to the whole context, 0 none; or a
    bool per layer, true where it slides) else llama.cpp's fixed pattern, over `attention.sliding_window`
    positions (0 in a gemma3 file: none), gemma3's rotating with `rope.freq_base_swa` (else 10,000) unscaled.
    llama.cpp's converter wrote every norm weight with the 1 of Gemma's x_normed * (1 + w) added, q/k norm and
    the final norm included: the weights are the norms' whole factors, so no offset is added at load. Where the
    two differ, transformers is followed: the embedding scale is rounded to the dtype, and a gemma3 file's
    attn_logit_softcapping (which llama.cpp's converter never writes, nor llama.cpp reads) caps the scores."""
    defaults = _GEMMA_DEFAULTS[arch]

    def get(key: str, kind: type, default: Any = _REQUIRED) -> Any:
        return _gguf_value(file, f"{arch}.{key}", kind, default)

    caps = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = get(name, float, defaults[name])
        if cap is not None and not positive(cap):
            raise ValueError(f"GGUF file {file.path!r} has {arch}.{name}={cap}; it must be a positive number "
                             "(x becomes cap * tanh(x / cap))")
        caps[name] = cap
    window = get("attention.sliding_window", int, defaults["window"])
    if window < (1 if arch == "gemma2" else 0):
        need = "Gemma 2's sliding layers need a window >= 1" if arch == "gemma2" else "it must be >= 0 (0: none)"
        raise ValueError(f"GGUF file {file.path!r} has {arch}.attention.sliding_window={window}; {need}")
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = file.metadata.get(key, defaults["pattern"])
    if type(pattern) is int and pattern >= 0:
        sliding = tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(layers))
    elif isinstance(pattern, list) and len(pattern) == layers and all(type(p) is bool for p in pattern):
        sliding = tuple(pattern)
    else:
        shown = f"{pattern[:8]}{'...' if len(pattern) > 8 else ''} ({len(pattern)} entries)" if isinstance(
            pattern, list) else repr(pattern)
        raise ValueError(f"GGUF file {file.path!r} has {key} = {shown}; it must be a period n >= 0 (each n-th layer "
                         f"attends to the whole context; 0: none does) or a bool for each of the {layers} layers "
                         "(true: it slides)")
    sliding = sliding if window and any(sliding) else None
    local = get("rope.freq_base_swa", float, None)
    if arch == "gemma2" and local is not None and local != rope_theta:
        raise ValueError(f"GGUF file {file.path!r} has {arch}.rope.freq_base_swa={local} apart from "
                         f"{arch}.rope.freq_base={rope_theta}; Gemma 2 rotates every layer with one base")
    if arch == "gemma3":
        local = defaults["local_rope_theta"] if local is None else local
        if not positive(local):
            raise ValueError(f"GGUF file {file.path!r} has {arch}.rope.freq_base_swa={local}; it must be a positive "
                             "number")
    scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    return dict(hidden_act="gelu_pytorch_tanh", qk_norm=arch == "gemma3", post_norms=True, norm_unit_offset=False,
                embedding_multiplier=hidden ** 0.5, embedding_multiplier_in_dtype=True,
                attention_multiplier=scalar ** -0.5, sliding_layers=sliding,
                sliding_window=window if sliding else None,
                local_rope_theta=local if arch == "gemma3" and sliding else None, **caps)


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
    features: dict[str, Any] = dict(
        qk_norm=arch == "qwen3", sliding_window=(get("attention.sliding_window", int, 0) or None) if arch == "phi3"
        else None)
    if arch == "granite":
        if not get("rope.scaling.finetuned", bool, True):
            raise ValueError(f"GGUF file {file.path!r} has granite.rope.scaling.finetuned=false, which "
                             "llama.cpp reads as no RoPE in any layer; tokenmill's granite rotates q and k")
        # 0, as llama.cpp reads it, and a key left out (its converter writes those config.json has) change
        # nothing
        features.update({name: value for name, key in GRANITE_MULTIPLIERS.items() if (value := get(key, float, 0.0))})
    rope_theta = get("rope.freq_base", float, 10000.0)
    if arch in _GEMMA_DEFAULTS:
        features.update(_gguf_gemma(file, arch, layers, hidden, heads, head_dim, rope_theta))
        # llama.cpp stops a Gemma model on <end_of_turn> (found by its text), as the checkpoints'
        # generation_config.json does: a chat turn ends there, not at <eos>
        tokens = md.get("tokenizer.ggml.tokens") or []
        if "<end_of_turn>" in tokens:
            eos.append(tokens.index("<end_of_turn>"))
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
        rope_theta=rope_theta,
        rope_scaling=scaling,
        max_position_embeddings=get("context_length", int),
        tie_word_embeddings="output.weight" not in file.tensors,
        attention_bias="blk.0.attn_q.bias" in file.tensors,
        eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
        bos_token_id=_gguf_value(file, "tokenizer.ggml.bos_token_id", int, None),
        dtype=dtype,
        rope_layers=rope_layers,
        rotary_dim=None if rotary == head_dim else rotary,
        **features,
    )
