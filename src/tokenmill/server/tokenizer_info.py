"""`GET /tokenizer_info` (served with `--enable-tokenizer-info-endpoint`, as vLLM's): the tokenizer's
configuration, tokenizer_config.json's fields as the loaded tokenizer holds them, for clients that rebuild
the server's tokenizer or its chat prompts."""
from __future__ import annotations

import json
import math

from tokenmill.server.errors import APIError

# fields that name files or the loader's arguments, not the tokenizer: tokenmill loads local directories
# only, so they would tell a client the server's file layout and nothing it could load (vLLM drops
# vocab_file and merges_file)
_LOADER_FIELDS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "special_tokens_map_file", "name_or_path",
                            "is_local", "local_files_only", "cache_dir"})

_SKIP = object()


def tokenizer_info(tokenizer, chat_template: str | None) -> dict:
    """vLLM's shape: the tokenizer's init kwargs (what tokenizer_config.json set: bos/eos/pad/unk tokens,
    model_max_length, added_tokens_decoder, chat_template, ...) with each token given as its text
    (added_tokens_decoder: {"id": text}), `tokenizer_class` the loaded class's name, and `chat_template`
    the one chat requests are rendered with (`--chat-template`'s where given). `tokenizer`: the engine's
    `Tokenizer` (None: a 404 saying so)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        raise APIError(404, "This model is served without a tokenizer, so there is no tokenizer to describe "
                            "(start the server with --tokenizer DIR).", code="tokenizer_not_found")
    config = {}
    for key, value in (getattr(hf, "init_kwargs", None) or {}).items():
        value = json_safe(value)
        if key not in _LOADER_FIELDS and value is not _SKIP:
            config[key] = value
    config["tokenizer_class"] = type(hf).__name__
    template = json_safe(chat_template or getattr(hf, "chat_template", None))
    if template and template is not _SKIP:
        config["chat_template"] = template
    return config


def json_safe(value):
    """`value` as JSON can hold it: an added token (tokenizers' AddedToken) as its text, mappings with
    string keys (JSON's; added_tokens_decoder's are ids), tuples and sets as lists, a float that is not
    finite as null. Any other object (a Python object handed to the tokenizer in code) is `_SKIP`: it has no
    JSON form a client could use."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(getattr(value, "content", None), str):
        return value.content
    if isinstance(value, dict):
        items = ((str(k), json_safe(v)) for k, v in value.items())
        return {k: v for k, v in items if v is not _SKIP}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [v for v in map(json_safe, value) if v is not _SKIP]
    return _SKIP


def dumps(info: dict) -> bytes:
    """The standard library's JSON, not orjson, which refuses integers past 64 bits: tokenizer configs write
    model_max_length as int(1e30) (transformers' "no limit")."""
    return json.dumps(info, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
