"""Gemma 2's and Gemma 3's config.json as transformers' Gemma2Config and Gemma3TextConfig read it, for
`hf_config.read_hf_config`: their defaults (`GEMMA_DEFAULTS`), Gemma 3's two RoPE bases (`gemma3_rope`) and their
layers' features as `ModelConfig` fields (`gemma_layers`): the norms, scales, soft caps and sliding layers."""
from __future__ import annotations

from typing import Any

from tokenmill.config_values import positive

GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GEMMA = ("Gemma2ForCausalLM", *GEMMA3)

# transformers' Gemma3TextConfig defaults, which a multimodal checkpoint's text_config mostly relies on
# (gemma-3-4b-it's names its sizes, RoPE scaling and window alone)
_GEMMA3_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096}
# per architecture, transformers' defaults for the keys a config.json may leave out (`hf_config._HF_DEFAULTS`);
# Gemma2Config's are gemma-2-2b's sizes, soft caps included: a config.json that leaves a cap out has it, one that
# sets it null has none
GEMMA_DEFAULTS = {
    "Gemma3ForCausalLM": _GEMMA3_DEFAULTS, "Gemma3ForConditionalGeneration": _GEMMA3_DEFAULTS,
    "Gemma2ForCausalLM": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1,
        "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}}


def gemma3_rope(hf: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Gemma 3's RoPE as transformers' Gemma3TextConfig reads it: (the full-attention layers' dict, rope_theta
    in it; the sliding layers' base). transformers 5 writes rope_parameters per layer type; older config.json
    files (the hub's) rope_scaling over the full-attention layers alone (gemma-3-4b's linear factor 8), rope_theta
    (1e6) and rope_local_base_freq (1e4), which fill what rope_parameters leaves out."""
    params = hf.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    full.update(hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", 1e6 if hf.get("rope_theta") is None else hf["rope_theta"])
    local.setdefault("rope_theta", 1e4 if hf.get("rope_local_base_freq") is None else hf["rope_local_base_freq"])
    kind = local.get("rope_type") or local.get("type") or "default"
    if kind != "default":
        raise ValueError(f"Gemma 3's sliding layers with RoPE of type {kind!r} are not supported: tokenmill scales "
                         "the full-attention layers' RoPE alone (rope_parameters' sliding_attention must be default)")
    for name, value in (("full_attention", full["rope_theta"]), ("sliding_attention", local["rope_theta"])):
        if not positive(value):
            raise ValueError(f"config.json's rope_theta of the {name} layers is {value!r}; it must be a positive "
                             "number")
    return full, float(local["rope_theta"])


def gemma_layers(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's and Gemma 3's features as `ModelConfig` fields, read as transformers' Gemma2 and Gemma3 compute
    them: four norms a layer (`post_norms`) with weights stored as offsets from 1, the embeddings times
    sqrt(hidden_size) rounded to the model's dtype, q.k scaled by query_pre_attn_scalar ** -0.5, the soft caps of
    the attention scores and of the logits (Gemma 2's 50 and 30; null: none, Gemma 3's), and the sliding layers:
    `layer_types`, else Gemma 2's every other layer from the first (Gemma2Config's) or all but Gemma 3's every
    sliding_window_pattern-th (6), over sliding_window positions. Bidirectional attention is refused."""
    arch = hf["architectures"][0]
    caps = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = hf.get(name)
        if cap is not None and not positive(cap):
            raise ValueError(f"config.json's {name} is {cap!r}; it must be a positive number (x becomes "
                             f"{name} * tanh(x / {name})), or null: none")
        caps[name] = None if cap is None else float(cap)
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} with use_bidirectional_attention is not supported: tokenmill's attention is causal")
    n, types = hf["num_hidden_layers"], hf.get("layer_types")
    if types is None and arch not in GEMMA3:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if types is None:
        pattern = hf.get("sliding_window_pattern", 6)
        if type(pattern) is not int or pattern < 1:
            raise ValueError(f"config.json's sliding_window_pattern is {pattern!r}; it must be an integer >= 1 (every "
                             "pattern-th layer attends to the whole context)")
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(
            t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(f"config.json's layer_types is {types!r}; it must name sliding_attention or full_attention "
                         f"for each of the num_hidden_layers={n} layers")
    sliding = tuple(t == "sliding_attention" for t in types)
    window = hf["sliding_window"]
    if any(sliding) and (type(window) is not int or window < 1):
        raise ValueError(f"config.json's sliding_window is {window!r}; {arch}'s sliding layers need an integer >= 1")
    scalar = hf["query_pre_attn_scalar"]
    if not positive(scalar):
        raise ValueError(f"config.json's query_pre_attn_scalar is {scalar!r}; it must be a positive number (q.k is "
                         "scaled by its inverse square root)")
    return dict(post_norms=True, norm_unit_offset=True, embedding_multiplier=hf["hidden_size"] ** 0.5,
                embedding_multiplier_in_dtype=True, attention_multiplier=scalar ** -0.5,
                sliding_layers=sliding if any(sliding) else None, sliding_window=window if any(sliding) else None,
                **caps)
