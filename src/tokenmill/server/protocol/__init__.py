"""OpenAI request schemas (plus vLLM's sampling extensions) as strict pydantic models.

Unknown fields are rejected (`extra="forbid"`) and types are strict where OpenAI's schema is: no
string is read as a number, no float as an integer, no number or string as a boolean. Fields that OpenAI defines but tokenmill does not
implement are listed in `_UNSUPPORTED` and accepted only at a value that changes nothing, so that
clients which send defaults keep working while anything that would be silently ignored is a 400.

Validation runs on the event loop, and pydantic makes an error of each mistake (~6 us each, made, turned into
dicts and described), while the bounds before it (server/body.py) admit a context's worth of messages, tools
or token ids and a vocabulary's worth of logit_bias entries: lists stop at their first mistake (`fail_fast`),
and logit_bias and a document at their first value of the wrong type (`numbers_only`, `text_fields_only`).

One module a concern, each importing only those before it: `base` (limits, `_Strict`, `UnsupportedValue`,
`_UNSUPPORTED`, shared validators), `tools` (function tools, tool_choice), `messages` (a chat's messages and
template fields), `options` (the objects sampling fields hold), `sampling` (`_SamplingRequest`, the fields
completions and chat completions share), then one module an endpoint: `completions`, `chat`, `tokenization`
(/tokenize, /detokenize), `responses` (/v1/responses, after `response_includes`, its `include` values, and
`response_items`, its input items). Here are re-exported the names the rest of tokenmill imports, but those of
the Responses modules, imported from them directly: `responses`' `as_chat` raises server/errors.py's APIError,
and errors.py imports this package.
"""
from tokenmill.server.protocol.base import (
    INT64_MAX, INT64_MIN, MAX_METADATA, MAX_PROMPT_CHARS, MAX_PROMPTS, MAX_TEMPLATE_KWARGS, MAX_UNKNOWN_NAMED,
    MAX_XARGS, PROMPT_CACHE_RETENTIONS, REASONING_EFFORTS, Metadata, UnsupportedValue, json_kind, refuse_media_parts,
)
from tokenmill.server.protocol.chat import ChatCompletionRequest
from tokenmill.server.protocol.completions import CompletionRequest
from tokenmill.server.protocol.messages import TEMPLATE_CALL_PARAMETERS, ChatMessage
from tokenmill.server.protocol.options import PromptCacheOptions
from tokenmill.server.protocol.tokenization import DetokenizeRequest, TokenizeRequest
from tokenmill.server.protocol.tools import (NamedToolChoice, check_function_parameters, function_choice_only,
                                             function_tools_only)

__all__ = [
    "INT64_MAX", "INT64_MIN", "MAX_METADATA", "MAX_PROMPT_CHARS", "MAX_PROMPTS", "MAX_TEMPLATE_KWARGS",
    "MAX_UNKNOWN_NAMED", "MAX_XARGS", "PROMPT_CACHE_RETENTIONS", "REASONING_EFFORTS", "TEMPLATE_CALL_PARAMETERS",
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "DetokenizeRequest", "Metadata", "NamedToolChoice",
    "PromptCacheOptions", "TokenizeRequest", "UnsupportedValue", "check_function_parameters", "function_choice_only",
    "function_tools_only", "json_kind", "refuse_media_parts",
]
