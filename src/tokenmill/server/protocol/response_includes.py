"""The `include` values a Responses request may ask for, and the reasoning text that
`reasoning.encrypted_content` carries."""
from __future__ import annotations

import base64

from tokenmill.sampling_params import shown

# `include: ["reasoning.encrypted_content"]` (what Codex and the Agents SDK send with `store: false`, to
# carry reasoning between turns themselves): reasoning items then carry their text in `encrypted_content`.
# It is encoded, not encrypted (this server holds no key and the text is in the item's content already);
# the prefix tells a blob of ours from another server's, which is ignored.
INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs")
INCLUDE_ENCRYPTED, INCLUDE_LOGPROBS = INCLUDES
_BLOB_PREFIX = "tokenmill-reasoning-v1."


def unknown_include(include: list[str] | None) -> str | None:
    """The refusal of the first `include` value this server has none of, None where there is none."""
    unknown = next((v for v in include or () if v not in INCLUDES), None)
    return f"'include' value {shown(unknown)} is not supported by tokenmill (only {', '.join(map(repr, INCLUDES))})" \
        if unknown is not None else None


def wrap_reasoning(text: str) -> str:
    return _BLOB_PREFIX + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def unwrap_reasoning(blob) -> str | None:
    if not isinstance(blob, str) or not blob.startswith(_BLOB_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(blob[len(_BLOB_PREFIX):]).decode("utf-8")
    except ValueError:
        return None
