"""A model's recommended sampling defaults, from its `generation_config.json`, as vLLM applies them
(`--generation-config auto`, its default): a request that leaves temperature, top_p, top_k, min_p or
repetition_penalty unset takes the model's value (Qwen3's: temperature 0.6, top_p 0.95, top_k 20) instead
of SamplingParams' own (temperature 1.0, no truncation). `vllm` keeps SamplingParams' defaults; a
directory reads that directory's `generation_config.json`. `do_sample` is not read, as vLLM does not: a
file that sets a temperature is taken to recommend it. `max_new_tokens` is not taken by the server: a
request's token budget stays its own (the endpoint's default), so that no request is refused for a budget it
never asked; the offline `LLM` takes it as max_tokens, as vLLM's does. The file's `eos_token_id` (and
config.json's) is read by `parse_eos_ids`, for the engine's stop ids; `read_json_object` reads these files.
"""
from __future__ import annotations

import json
import os
from typing import Any

# generation_config.json's keys that set the SamplingParams fields of the same names
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(source: str, model: str, overrides: dict | None = None, budget: bool = False) -> dict:
    """The SamplingParams fields that requests default to: from `source` ("auto": the `model` directory's
    generation_config.json where it has one; "vllm": none; else a directory that must hold one), then
    `overrides` (generation_config.json's keys, vLLM's --override-generation-config). `budget`: its
    max_new_tokens too, as max_tokens (vLLM's offline LLM takes it; the server does not). A ValueError
    names an unknown source or key, or a value SamplingParams refuses."""
    found: dict = {}
    if source != "vllm":
        folder = model if source == "auto" else source
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            config = read_json_object(path)
            found = {key: config[key] for key in KEYS if config.get(key) is not None}
            if budget and config.get("max_new_tokens") is not None:
                found["max_tokens"] = config["max_new_tokens"]
        elif source != "auto":
            raise ValueError(f"--generation-config {source!r}: no generation_config.json there (give 'auto' for "
                             "the model's own, 'vllm' for none, or a directory that holds one)")
    for key, value in (overrides or {}).items():
        if key == "max_new_tokens":
            raise ValueError("--override-generation-config: max_new_tokens is not taken by the server: each "
                             "request's max_tokens stays its own (the endpoint's default where it sets none)")
        if key not in KEYS:
            raise ValueError(f"--override-generation-config: unknown key {key!r}; known: {', '.join(KEYS)}")
        if value is None:           # as vLLM reads a null: no default for this key, not even the file's
            found.pop(key, None)
        else:
            found[key] = value
    for key, value in found.items():
        # SamplingParams compares what it is given with numbers: a string's TypeError named no key
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"the generation config's {key} must be a number, got {json.dumps(value)}")
    from tokenmill.sampling_params import SamplingParams
    try:
        SamplingParams(**found)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the generation config's sampling defaults {found}: {e}") from None
    return found


def parse_eos_ids(value: Any, source: str) -> tuple[int, ...]:
    """An `eos_token_id` of config.json or generation_config.json (an id, a list of ids, or null) -> the ids;
    `source` names the file in the error. A string or a negative number would never match a sampled token,
    so generation would silently not stop there."""
    ids = list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"{source}'s eos_token_id must be a token id or a list of them (integers >= 0), "
                         f"got {json.dumps(value)}")
    return tuple(ids)


def read_json_object(path: str) -> dict:
    """A JSON file holding an object (config.json, generation_config.json, quantize_config.json) as a dict; a
    ValueError names the file where it cannot be read or is not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object but a JSON {type(value).__name__}")
    return value


def describe(defaults: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in defaults.items()) or "none"
