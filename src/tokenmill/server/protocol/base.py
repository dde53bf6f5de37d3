"""What every request model shares: the limits on its fields, `UnsupportedValue` (a 400 naming its field),
`_Strict` (unknown fields refused, as one error where there are several), the OpenAI and vLLM fields accepted
only at a value that changes nothing (`_UNSUPPORTED`), and the before-validators that refuse a whole kind of
input with one error (media parts, non-number logit_bias values, non-string document fields)."""
from __future__ import annotations

import functools
import itertools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from tokenmill.sampling_params import MAX_SHOWN_CHARS, shown

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_PROMPTS = 256
MAX_PROMPT_CHARS = 4_000_000      # one prompt, or the text of all of a chat's messages together
# OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512
MAX_METADATA = 16
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=MAX_METADATA)]
# a template reads a handful of variables; more than this many is no template's
MAX_TEMPLATE_KWARGS = 256
# vLLM's vllm_xargs, data for sampling plugins that no sampler here reads: a few settings, not a payload
MAX_XARGS = 256
# bad_words are tokenized on the event loop (`AsyncLLM.generate`): a few short words, bounded
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 128, 256
# a client's request id is logged with every line of its request: an id, not a payload
MAX_REQUEST_ID = 256
REASONING_EFFORTS = Literal["none", "minimal", "low", "medium", "high"]
# how long OpenAI keeps a prompt's cache: no answer depends on it. "in-memory" is how OpenAI's API reference
# first spelled it (and the Agents SDK for JavaScript still sends it), "in_memory" the openai client's since
PROMPT_CACHE_RETENTIONS = Literal["in_memory", "in-memory", "24h"]


class UnsupportedValue(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# the unknown fields of one object that an error names at most (with how many more there are)
MAX_UNKNOWN_NAMED = 8


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _one_error_for_unknown_fields(cls, data):
        """An object with two or more fields the model does not know is one error ("unknown_fields", naming the
        first `MAX_UNKNOWN_NAMED` and their count); one such field is pydantic's error, beside those of the fields
        it then finds missing. Pydantic makes an error of each, and the event loop spent ~6 us on each (made,
        turned into dicts, described): 1M unknown fields in a 14 MB body held it 6.4 s, and 18 in each of
        40,960 messages (4.4 MB) would have made 737,280."""
        if type(data) is dict:
            known = _field_names(cls)
            if not known.issuperset(data):
                count = len(data) - len(known.intersection(data))
                if count > 1:
                    named = list(itertools.islice((key for key in data if key not in known), MAX_UNKNOWN_NAMED))
                    raise PydanticCustomError("unknown_fields", "{count} unknown or unsupported fields",
                                              {"count": count, "named": named})
        return data


@functools.cache
def _field_names(model: type[BaseModel]) -> frozenset[str]:
    """The keys `model` reads: its fields' names and their aliases."""
    return frozenset(name for key, field in model.model_fields.items()
                     for name in (key, field.alias, field.validation_alias) if isinstance(name, str))


def _noop_bool(v):
    return v is None or v is False


def _empty(v):
    return v is None or v == {} or v == [] or v == ""


# field -> (what value is accepted, predicate): OpenAI fields whose other values would change the result
_UNSUPPORTED: dict[str, tuple[str, Any]] = {
    "suffix": ("null or empty", _empty),
    "functions": ("null or empty (use 'tools')", _empty),
    "function_call": ('null or "none" (use \'tool_choice\')', lambda v: v is None or v == "none"),
    "store": ("false (chat completions are not stored; /v1/responses stores)", _noop_bool),
    "service_tier": ('null, "auto" or "default"', lambda v: v in (None, "auto", "default")),
    "reasoning_effort": ("null", lambda v: v is None),
    "modalities": ('null or ["text"]', lambda v: v is None or v == ["text"]),
    "audio": ("null", lambda v: v is None),
    "web_search_options": ("null", lambda v: v is None),
    # the default: Responses' text.verbosity takes the same
    "verbosity": ('null or "medium"', lambda v: v in (None, "medium")),
    # vLLM's extra fields for what tokenmill does not do, which vLLM clients send at their defaults
    "use_beam_search": ("false (beam search is not implemented)", _noop_bool),
    "length_penalty": ("1.0 (it weighs beams, and beam search is not implemented)",
                       lambda v: v is None or (type(v) in (int, float) and v == 1)),
    "chat_template": ("null (the chat template is the server's: --chat-template)", lambda v: v is None),
    "guided_decoding_backend": ('null, "auto" or "xgrammar" (the backend structured output uses)',
                                lambda v: v in (None, "auto", "xgrammar")),
    "guided_whitespace_pattern": ("null (set structured_outputs.disable_any_whitespace for compact JSON)",
                                  lambda v: v is None),
    "structural_tag": ("null", lambda v: v is None),
    "logits_processors": ("null or empty (per-request logits processors are not run)", _empty),
    "kv_transfer_params": ("null (no disaggregated prefill)", lambda v: v is None),
    "mm_processor_kwargs": ("null or empty (the models served read text only)", _empty),
    "media_io_kwargs": ("null or empty (the models served read text only)", _empty),
    "prompt_embeds": ("null (prompts are text or token ids)", lambda v: v is None),
}


def _refuse_unsupported(req: BaseModel, honored: frozenset[str] = frozenset()) -> None:
    """A 400 for an `_UNSUPPORTED` field the request set to a value that would change something."""
    for name in req.model_fields_set:
        if name in _UNSUPPORTED and name not in honored:
            accepted, ok = _UNSUPPORTED[name]
            try:
                fine = ok(getattr(req, name))
            except Exception:
                fine = False
            if not fine:
                raise UnsupportedValue(name, f"'{name}' is not supported by tokenmill (only {accepted} is accepted)")


# content parts of other modalities, refused by their type: every model served here reads text only
MEDIA_PARTS = ("image_url", "input_image", "input_audio", "audio_url", "video_url", "file", "input_file")


def refuse_media_parts(content, field: str):
    """A message's content as given, unless a part of it is an image, audio, video or file: then a 400 that
    says so (rather than one listing the fields such a part has and a text part lacks)."""
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                raise UnsupportedValue(field, f"'{kind}' content is not supported: tokenmill serves text-only "
                                              "models (send the message's text as text parts)")
    return content


def json_kind(value) -> str:
    """A value's JSON type, for 'expected X (got Y)' messages."""
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"number {value!r}"
    if isinstance(value, str):
        return f"string {value[:MAX_SHOWN_CHARS]!r}"
    return {list: "array", dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


def numbers_only(bias):
    """A logit_bias as given, unless one of its values is not a number: then one error naming the first such
    entry, where pydantic made an error of each (a vocabulary's worth, 151,936 entries of strings, held the
    event loop ~1 s)."""
    if type(bias) is dict:
        for key, value in bias.items():
            if type(value) is not float and type(value) is not int:
                raise UnsupportedValue("logit_bias", f"logit_bias values are numbers (a token's bias): the value "
                                                     f"for {shown(key)} is {json_kind(value)}")
    return bias


def text_fields_only(documents):
    """A chat's documents as given, unless a document's field is not a string: then one error naming the first,
    where pydantic made an error of each field (a document may hold a context's worth)."""
    for i, document in enumerate(documents if type(documents) is list else ()):
        for key, value in document.items() if type(document) is dict else ():
            if type(value) is not str:
                raise UnsupportedValue("documents", f"document {i}'s field {shown(key)} is {json_kind(value)}: a "
                                                    "document's fields are strings")
    return documents
