"""OpenAI request schemas (plus vLLM's sampling extensions) as strict pydantic models.

Unknown fields are rejected (`extra="forbid"`) and types are strict where OpenAI's schema is: no
string is read as a number, no float as an integer, no number or string as a boolean. Fields that OpenAI defines but tokenmill does not
implement are listed in `_UNSUPPORTED` and accepted only at a value that changes nothing, so that
clients which send defaults keep working while anything that would be silently ignored is a 400.

Validation runs on the event loop, and pydantic makes an error of each mistake (~6 us each, made, turned into
dicts and described), while the bounds before it (server/body.py) admit a context's worth of messages, tools
or token ids and a vocabulary's worth of logit_bias entries: lists stop at their first mistake (`fail_fast`),
and logit_bias and a document at their first value of the wrong type (`numbers_only`, `text_fields_only`).
"""
from __future__ import annotations

import functools
import itertools
import json
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from tokenmill.sampling_params import MAX_SHOWN_CHARS, MAX_SPEC_CHARS, SamplingParams, json_chars_at_least, shown

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_PROMPTS = 256
COMPLETION_MAX_TOKENS = 16       # OpenAI's default max_tokens for completions
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


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, fail_fast=True)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    def spec(self) -> dict[str, Any]:
        given = {k: v for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                   ("grammar", self.grammar), ("json_object", self.json_object or None))
                 if v is not None}
        if len(given) != 1:
            raise UnsupportedValue("structured_outputs", "'structured_outputs' takes exactly one of json, regex, "
                                                         f"choice, grammar or json_object (got {len(given)})")
        if self.disable_any_whitespace is not None:
            given["disable_any_whitespace"] = self.disable_any_whitespace
        return given


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = False
    # OpenAI's padding of streamed chunks against length side channels: this server adds none
    include_obfuscation: bool | None = None


class PromptCacheOptions(_Strict):
    """OpenAI's prompt_cache_options (where its docs move prompt_cache_retention): how long and from where OpenAI
    caches a prompt, which no answer here depends on; a prewarm (a request answered with nothing) and a
    comparison of cache use with another response are refused."""
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m", "12h"] | None = None
    prewarm: bool | None = None
    comparison_response_id: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.prewarm:
            raise UnsupportedValue("prompt_cache_options.prewarm", "prompt_cache_options.prewarm is not supported "
                                   "by tokenmill (only false): every request here is answered")
        if self.comparison_response_id is not None:
            raise UnsupportedValue("prompt_cache_options.comparison_response_id", "prompt_cache_options."
                                   "comparison_response_id is not supported by tokenmill (only null): it has no "
                                   "prompt cache diagnostics")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class Prediction(_Strict):
    type: Literal["content"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[TextPart], Field(fail_fast=True)]


class _SamplingRequest(_Strict):
    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]],
                              Field(max_length=MAX_STOP, fail_fast=True)] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's: each prompt token's logprob and this many alternatives (completions: in each choice; chat: in
    # the response), not with stream
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    user: str | None = None
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = 0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]],
                                 Field(min_length=1, fail_fast=True)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    # vLLM's: the logprobs' tokens as "token_id:{id}" (the text of two tokens may be equal)
    return_tokens_as_token_ids: bool | None = None
    bad_words: Annotated[list[Annotated[str, Field(max_length=MAX_BAD_WORD_CHARS)]],
                         Field(max_length=MAX_BAD_WORDS, fail_fast=True)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, fail_fast=True)] | None = None
    guided_grammar: str | None = None
    # vLLM's: requests share prefix-cache blocks only with requests of the same salt (`SamplingParams.cache_salt`)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # vLLM's: the id the response is named by ("cmpl-{id}", "chatcmpl-{id}") and the request logged under,
    # unless an X-Request-Id header gives one (`Serving.response_id`)
    request_id: Annotated[str, Field(max_length=MAX_REQUEST_ID)] | None = None
    # vLLM's: the prompt's token ids and each choice's generated ones in the answer (streamed: the prompt's
    # with a choice's first chunk, and each chunk's new tokens)
    return_token_ids: bool | None = None
    # vLLM's: either value changes nothing (`SamplingParams.spaces_between_special_tokens`)
    spaces_between_special_tokens: bool | None = True
    # vLLM's data for sampling plugins (`SamplingParams.extra_args`), which no sampler here reads
    vllm_xargs: Annotated[dict[str, str | int | float | Annotated[list[str | int | float], Field(fail_fast=True)]],
                          Field(max_length=MAX_XARGS)] | None = None

    # Fields that change nothing here: accepted as OpenAI defines them.
    metadata: Metadata | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: PROMPT_CACHE_RETENTIONS | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = None
    # OpenAI's predicted output: a guess at the answer that speeds decoding up and leaves the answer as it is
    prediction: Prediction | None = None

    # `_UNSUPPORTED` fields a request type does honor (its own field's type checks them instead)
    honored: ClassVar[frozenset[str]] = frozenset()

    _numbers_only = field_validator("logit_bias", mode="before")(numbers_only)

    # OpenAI fields accepted only at a no-op value (see `_UNSUPPORTED`).
    suffix: Any = None
    best_of: Any = None
    functions: Any = None
    function_call: Any = None
    store: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    chat_template: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    logits_processors: Any = None
    kv_transfer_params: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    prompt_embeds: Any = None

    @model_validator(mode="after")
    def _check_unsupported(self):
        _refuse_unsupported(self, self.honored)
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise UnsupportedValue("best_of", "'best_of' is not supported by tokenmill (only best_of == n is accepted)")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedValue("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if self.prompt_logprobs is not None and self.stream:
            raise UnsupportedValue("prompt_logprobs", "'prompt_logprobs' is not available when 'stream' is true")
        self.structured_spec()
        return self

    def structured_spec(self) -> tuple[str, dict[str, Any]] | None:
        """The one output constraint asked for, as (the field that asked, {kind: value}), or None."""
        asked: list[tuple[str, dict[str, Any]]] = []
        # OpenAI's JSON modes (and tool calls) are decoded in compact JSON, separators as json.dumps writes
        # them: free whitespace between tokens lets a model loop on newlines until max_tokens
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", {"json_object": True, "disable_any_whitespace": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise UnsupportedValue("response_format", "response_format of type 'json_schema' needs "
                                                          "'json_schema.schema'")
            asked.append(("response_format", {"json": rf.json_schema.schema_, "disable_any_whitespace": True}))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs.spec()))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {kind: getattr(self, name)}))
        asked += self._extra_constraints()
        if any(name == "tool_choice" for name, _ in asked):
            # a call that tool_choice forces is decoded under the tools' schemas, and leaves no message content
            # for response_format to shape: both are taken, as OpenAI and vLLM take them (the Agents SDK sends an
            # agent's output_type beside a forced tool choice)
            asked = [(name, kinds) for name, kinds in asked if name != "response_format"]
        if len(asked) > 1:
            raise UnsupportedValue(asked[1][0], "only one output constraint per request: "
                                               + ", ".join(f"'{name}'" for name, _ in asked) + " were given")
        return asked[0] if asked else None

    def _extra_constraints(self) -> list[tuple[str, dict[str, Any]]]:
        return []

    def _auto_tools(self) -> bool:
        """Whether the model may call tools or answer (tools shown, tool_choice "auto")."""
        return False

    def field_of(self, param: str | None) -> str | None:
        """The request's own field for an error about its output constraint, which the engine names by its
        `structured_outputs` (the schema of a response_format, or of the tools a tool_choice forces; in the
        structural tag of tools beside a response_format, by the path of the part it is about)."""
        if param is None or not param.startswith("structured_outputs"):
            return param
        from tokenmill.server.tool_choice import CALLS_PATH
        if param.startswith(f"structured_outputs.structural_tag.{CALLS_PATH}"):
            return "tools"
        spec = self.structured_spec()
        origin = spec[0] if spec is not None else None
        return {None: param, "structured_outputs": param, "tool_choice": "tools"}.get(origin, origin)

    def structured_params(self, call_form=None):
        """The engine's StructuredOutputsParams for the request's constraint, or None. `call_form`: how the
        server's tool-call parser writes calls (`tool_parsers.base.CallForm`), where tool_choice "auto" reads them."""
        spec = self.structured_spec()
        if spec is None:
            return None
        from tokenmill.sampling_params import StructuredOutputsParams
        field, kinds = spec
        if call_form is not None and field == "response_format" and self._auto_tools():
            # the format shapes the answer, not the calls the model may write instead (as OpenAI has it)
            from tokenmill.server.tool_choice import calls_or_format
            schema = {"type": "object"} if "json_object" in kinds else kinds["json"]
            check_tools_chars([t.function for t in self.tools])
            try:
                tag = calls_or_format(self.tools_in_use(), call_form, schema,
                                      parallel_tool_calls=getattr(self, "parallel_tool_calls", None) is not False)
            except ValueError as e:
                raise UnsupportedValue("tools", f"cannot constrain the output to these tools: {e}") from None
            # a schema's error names the part of the tag it is in (`field_of`)
            return StructuredOutputsParams(structural_tag=json.dumps(tag), disable_any_whitespace=True)
        if "tools" in kinds:
            from tokenmill.server.tool_choice import required_tools_schema
            tools, choice = kinds["tools"]
            try:
                schema = required_tools_schema(tools, choice,
                                               parallel_tool_calls=getattr(self, "parallel_tool_calls", None) is not False)
            except ValueError as e:
                raise UnsupportedValue("tool_choice", f"cannot constrain the output to these tools: {e}") from None
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        try:
            return StructuredOutputsParams(**kinds)
        except ValueError as e:
            raise UnsupportedValue(field, f"{field}: {e}") from None

    def token_bias(self) -> dict[int, float] | None:
        """`logit_bias` with integer keys; range and vocabulary checks happen in SamplingParams."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            # decimal digits only: int() also takes "5_0", " 7 " and non-ASCII digits, each a mistyped key
            # that would bias some other token
            # and at most 19 digits (int64): int() refuses past 4,300 with a message about Python
            if not (key.isascii() and key.isdigit()) or len(key) > 19:
                raise UnsupportedValue("logit_bias", f"logit_bias keys are token ids, got {key[:40]!r}"
                                                     + (f" ({len(key)} characters)" if len(key) > 40 else ""))
            out[int(key)] = float(value)
        return out

    def stream_usage(self) -> tuple[bool, bool]:
        """(a last chunk with the usage, the usage so far in every chunk). vLLM's continuous_usage_stats alone
        asks for both, as vLLM reads it (its include_usage defaults to true); OpenAI's options alone give the
        usage chunk only where include_usage says so."""
        opts = self.stream_options
        if opts is None:
            return False, False
        include = bool(opts.continuous_usage_stats) if opts.include_usage is None else opts.include_usage
        return include, include and bool(opts.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_field(self) -> str:
        """The field `requested_max_tokens` reads, as refusals name it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def sampling_params(self, logprobs: int | None, defaults: dict | None = None, call_form=None,
                        **overrides) -> SamplingParams:
        """Build the engine's parameters; raises ValueError naming a bad value and its limit. `defaults`:
        the fields a request that leaves them unset takes (`generation_config.sampling_defaults`);
        `call_form`: `structured_params`'."""
        kw: dict[str, Any] = dict(
            n=self.n or 1,
            max_tokens=self.requested_max_tokens(),
            min_tokens=self.min_tokens or 0,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            prompt_logprobs=self.prompt_logprobs,
        )
        defaults = defaults or {}
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                kw[name] = float(value)
        top_k = self.top_k if self.top_k is not None else defaults.get("top_k")
        if top_k is not None:
            kw["top_k"] = int(top_k)
        if self.seed is not None:
            kw["seed"] = self.seed
        bias = self.token_bias()
        if bias:
            kw["logit_bias"] = bias
        if self.allowed_token_ids is not None:
            kw["allowed_token_ids"] = self.allowed_token_ids
        if self.truncate_prompt_tokens is not None:
            kw["truncate_prompt_tokens"] = self.truncate_prompt_tokens
        if self.bad_words:
            kw["bad_words"] = self.bad_words
        if self.cache_salt is not None:
            kw["cache_salt"] = self.cache_salt
        if self.vllm_xargs is not None:
            kw["extra_args"] = self.vllm_xargs
        constraint = self.structured_params(call_form)
        if constraint is not None:
            kw["structured_outputs"] = constraint
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**kw)


def check_tools_chars(tools: list, named: str | None = None) -> None:
    """The parameters of the tools (FunctionDefinition's) a grammar holds, those of the function `named` else
    all, within its MAX_SPEC_CHARS as JSON before a schema is built of them: the schema holds each, so it would
    be refused once built (35,678 tools of 24 properties, 26 MB, took 4.8 s)."""
    chars = sum(json_chars_at_least(fn.parameters or {}) for fn in tools if named is None or fn.name == named)
    if chars > MAX_SPEC_CHARS:
        raise UnsupportedValue("tools", f"the tools' parameters are at least {chars:,} characters of JSON schema "
                                        f"together, over the grammar's limit of {MAX_SPEC_CHARS:,}")


PromptType = Union[
    Annotated[str, Field(max_length=MAX_PROMPT_CHARS)],
    Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]], Field(min_length=1, fail_fast=True)],
    Annotated[list[Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]],
              Field(min_length=1, max_length=MAX_PROMPTS, fail_fast=True)],
    Annotated[list[Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]], Field(min_length=1, fail_fast=True)]],
              Field(min_length=1, max_length=MAX_PROMPTS, fail_fast=True)],
]


_JSON_KINDS = {bool: "booleans", int: "integers", float: "numbers", str: "strings", list: "lists", dict: "objects",
               type(None): "nulls"}


def _json_kinds(items: list) -> list[str]:
    """The JSON types of a list's items, as words."""
    return sorted(_JSON_KINDS.get(t, t.__name__) for t in set(map(type, items)))


def _prompt_shape_error(prompt: list) -> str | None:
    """What a list that fits no branch of `PromptType` holds, in a sentence (pydantic's message tells every
    branch's failure, each contradicting the next), or None where its items are of the right kinds."""
    if not prompt:
        return ("'prompt' is an empty list: a prompt is a string or a list of token ids, and a batch a list of "
                "strings or of token-id lists")
    kinds = _json_kinds(prompt)
    if len(kinds) > 1 or kinds[0] not in ("strings", "integers", "lists"):
        return (f"'prompt' holds {' and '.join(kinds)}: a prompt is a string or a list of token ids (integers), "
                "and a batch a list of strings or of token-id lists")
    for i, ids in enumerate(prompt if kinds[0] == "lists" else ()):
        if not ids:
            return f"prompt {i} of the batch is an empty list of token ids"
        others = [kind for kind in _json_kinds(ids) if kind != "integers"]
        if others:
            return f"prompt {i} of the batch holds {' and '.join(others)}: token ids are integers"
    return None


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    # OpenAI's default for completions (chat completions default to the rest of the context)
    max_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = COMPLETION_MAX_TOKENS
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = False
    add_special_tokens: bool | None = True
    honored: ClassVar[frozenset[str]] = frozenset({"echo"})

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, prompt, handler):
        try:
            return handler(prompt)
        except ValidationError:
            why = _prompt_shape_error(prompt) if type(prompt) is list else None
            if why is None:
                raise
        raise UnsupportedValue("prompt", why)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_max_tokens(cls, value):
        # an explicit null is the default too (as vLLM reads it), not the rest of the context: clients that
        # send every field, unset ones as null, expect 16 tokens
        return COMPLETION_MAX_TOKENS if value is None else value

    @model_validator(mode="after")
    def _check_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedValue("max_tokens", "max_tokens must be at least 1 (0 only with echo)")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class RefusalPart(_Strict):
    """An assistant's refusal as OpenAI returns it and clients send it back: text to the template (vLLM's)."""
    type: Literal["refusal"]
    refusal: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]

    @property
    def text(self) -> str:
        return self.refusal


def _part_class(part) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return {"text": "TextPart", "refusal": "RefusalPart"}.get(kind)


# a part is read by its type alone; each branch is tagged by its class name, which error paths leave out
ContentPart = Annotated[Union[Annotated[TextPart, Tag("TextPart")], Annotated[RefusalPart, Tag("RefusalPart")]],
                        Discriminator(_part_class, custom_error_type="invalid_content_part",
                                      custom_error_message="a content part's type is 'text' or 'refusal'")]


class FunctionCall(_Strict):
    name: str
    arguments: str
    # the openai client's parse() helpers keep the arguments they parsed beside them: the same data as
    # `arguments`, which alone is read
    parsed_arguments: Any = None


class ToolCallParam(_Strict):
    """An assistant message's tool call, as the API returned it and clients send it back."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    # the openai client's stream helper keeps each call's position in the stream's deltas
    index: Any = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[ContentPart], Field(fail_fast=True)] \
        | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallParam], Field(fail_fast=True)] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # vLLM's current name of the same text (and OpenRouter's), which their clients send back
    reasoning: str | None = None
    # what clients echo back from a returned message: accepted when null or empty
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None
    # the openai client's parse() helpers keep the content they parsed beside it: the same data as `content`,
    # which alone is read (any value)
    parsed: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        return refuse_media_parts(content, "messages.content")

    @model_validator(mode="after")
    def _check_fields(self):
        for name in ("refusal", "annotations", "audio", "function_call"):
            if not _empty(getattr(self, name)):
                raise UnsupportedValue(f"messages.{name}", f"a message's '{name}' is not supported by tokenmill "
                                                           "(only null or empty is accepted)")
        if self.tool_calls and self.role != "assistant":
            raise UnsupportedValue("messages.tool_calls", "only assistant messages carry 'tool_calls'")
        if self.role == "tool" and self.tool_call_id is None:
            raise UnsupportedValue("messages.tool_call_id", "a 'tool' message needs 'tool_call_id'")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise UnsupportedValue("messages.reasoning", "a message's 'reasoning' and 'reasoning_content' name one "
                                                         "text: give one of them, or the same text in both")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)      # vLLM's join: parts stay apart

    def for_template(self) -> dict:
        """The message as chat templates read it (Hugging Face's convention: tool-call arguments as
        objects where they parse, the developer role as system)."""
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            # under both names, as vLLM hands it over: templates read one or the other (Qwen3's
            # reasoning_content)
            d["reasoning_content"] = d["reasoning"] = reasoning
        return d


def _arguments(text: str):
    # empty arguments are a call of no arguments ({}, as vLLM reads them), not a text: a template that writes
    # string arguments as they stand wrote them as `"arguments": }`; other text that is no JSON object stays
    # as the model wrote it (say, cut short by max_tokens)
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):      # not JSON, or nested past the parser's recursion limit
        return text
    return value if isinstance(value, dict) else text


def _json_shown(value) -> str:
    """`value` as JSON, as an error quotes it: a string cut as `shown` cuts it, a list to its first 4 items."""
    if isinstance(value, str):
        return json.dumps(value) if len(value) <= MAX_SHOWN_CHARS else \
            f"{json.dumps(value[:MAX_SHOWN_CHARS])}... ({len(value):,} characters)"
    if isinstance(value, list):
        return "[" + ", ".join(_json_shown(v) if isinstance(v, str) else shown(v) for v in value[:4]) \
            + (", ...]" if len(value) > 4 else "]")
    return shown(value)


def check_function_parameters(params: dict | None) -> dict | None:
    """A function tool's `parameters`, checked: a schema of an object (OpenAI's rule: a function's arguments
    are one JSON object; a schema naming no type takes it), its `$defs` / `definitions` objects."""
    kind = (params or {}).get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise UnsupportedValue("tools", f'a function\'s parameters must be a JSON Schema of type "object", '
                                        f"got type {_json_shown(kind)}")
    for key in ("$defs", "definitions"):
        if key in (params or {}) and not isinstance(params[key], dict):
            raise UnsupportedValue("tools", f"a function's parameters.{key} must be an object of schemas, "
                                            f"got {type(params[key]).__name__}")
    return params


def function_tools_only(tools):
    """A request's tools as given, unless one is of a type this server does not run (OpenAI's built-in tools,
    custom and MCP tools): then a 400 naming that type, rather than one listing the fields a function would need
    or calling the tool's own fields unknown. Chat completions and Responses alike."""
    for tool in tools if isinstance(tools, list) else ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise UnsupportedValue("tools", f"tool type {shown(kind)} is not supported by tokenmill (only 'function')")
    return tools


def function_choice_only(choice):
    """A tool_choice as given, unless it is an object of a type other than a function (allowed_tools, a custom or
    built-in tool): then a 400 naming that type, as `function_tools_only` does for a tool."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind != "function":
        raise UnsupportedValue("tool_choice", f"tool_choice type {shown(kind)} is not supported by tokenmill (only "
                                              "'none', 'auto', 'required' or a function by name)")
    return choice


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _check_parameters = field_validator("parameters")(check_function_parameters)


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def _check_chat_length(messages: list[ChatMessage] | None) -> None:
    """The messages' text together, their reasoning (under either name) and tool calls' arguments included,
    within `MAX_PROMPT_CHARS`: the template renders the arguments too, parsed (`_arguments`) on the event
    loop and walked node by node on the tokenizer thread every request shares (21 MB of them, 7M empty
    lists, held the loop 1.3 s, took 1.5 GB and held other clients' prompts 11.6 s)."""
    total = sum(len(m.text()) + len(m.reasoning_content or m.reasoning or "")
                + sum(len(c.function.arguments) for c in m.tool_calls or ())
                for m in messages or ())
    if total > MAX_PROMPT_CHARS:
        raise UnsupportedValue("messages", f"The messages hold {total} characters together (reasoning and tool "
                                           f"call arguments included); the limit is {MAX_PROMPT_CHARS}.")


# Names chat_template_kwargs may not use: the template call's own parameters (Hugging Face's
# apply_chat_template and ours), which are not template variables; set there, they collided with ours (a
# 500) or replaced the server's template with the client's (whose Jinja, sandboxed but unbounded, runs on
# the one tokenizer thread every request shares). `documents` stays: it reaches the template as a variable.
_USE_FIELD = "set by the request's own field of that name"
TEMPLATE_CALL_PARAMETERS = {
    "messages": _USE_FIELD, "conversation": "the request's 'messages' are the conversation",
    "add_generation_prompt": _USE_FIELD, "continue_final_message": _USE_FIELD, "tools": _USE_FIELD,
    "chat_template": "the chat template is the server's (--chat-template)",
    **{name: "a parameter of the template call, not a template variable" for name in (
        "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs")},
}


def _check_template_fields(req) -> None:
    """A chat request's template fields (chat completions and /tokenize alike): no template-call parameter in
    chat_template_kwargs; continue_final_message only without a generation prompt, after the assistant's."""
    for key in req.chat_template_kwargs or ():
        if key in TEMPLATE_CALL_PARAMETERS:
            raise UnsupportedValue("chat_template_kwargs", f"chat_template_kwargs may not set {key!r}: "
                                   + TEMPLATE_CALL_PARAMETERS[key])
    if req.continue_final_message and req.add_generation_prompt:
        raise UnsupportedValue("continue_final_message", "'continue_final_message' and "
                               "'add_generation_prompt' cannot both be true (set add_generation_prompt false)")
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise UnsupportedValue("continue_final_message", "'continue_final_message' needs the last message "
                                                         "to be the assistant's")


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(fail_fast=True)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None
    # vLLM's: the template's `documents` (retrieval-augmented generation); a template that reads none ignores them
    documents: Annotated[list[dict[str, str]], Field(fail_fast=True)] | None = None
    # passed to the chat template, as vLLM does; refused where the template does not read it (`prepare_chat`)
    reasoning_effort: REASONING_EFFORTS | None = None
    # vLLM's: false leaves reasoning_content out (null) of the answer; the thinking is still parsed out of the
    # content and counted in usage
    include_reasoning: bool | None = True
    # vLLM's: the tokenizer's special tokens (BOS) added to the rendered prompt, beside those the template writes
    add_special_tokens: bool | None = False
    # vLLM's: the reply's content is prefixed with the last message's, where that is the assistant's (`echoed`)
    echo: bool | None = False
    honored: ClassVar[frozenset[str]] = frozenset({"reasoning_effort"})

    _function_tools_only = field_validator("tools", mode="before")(function_tools_only)
    _function_choice_only = field_validator("tool_choice", mode="before")(function_choice_only)
    _text_fields_only = field_validator("documents", mode="before")(text_fields_only)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedValue("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
        _check_chat_length(self.messages)
        _check_template_fields(self)
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise UnsupportedValue("tool_choice", f"tool_choice names the function "
                                       f"{shown(self.tool_choice.function.name)}, which is not among the tools "
                                       f"{shown(names)}")
        elif self.tool_choice == "required" and not self.tools:
            raise UnsupportedValue("tool_choice", "tool_choice 'required' needs at least one tool")
        if self.echo and self._extra_constraints():
            raise UnsupportedValue("echo", "'echo' prefixes the reply's content, and a tool_choice that forces a "
                                           "call leaves it none (use tool_choice 'auto' or leave 'echo' out)")
        return self

    def echoed(self) -> str:
        """The text `echo` puts before each choice's content: the last message's where it is the assistant's,
        the role the reply has (vLLM's rule; its logprobs stay the generated tokens'), else none."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def tools_in_use(self) -> list[dict] | None:
        """The tools the template shows the model: with tool_choice "none" too, as vLLM shows them (unless
        started with --exclude-tools-when-tool-choice-none) and as OpenAI's models still know them; that
        output is then not read for calls. An agent's turns with and without calls share a cached prefix."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def _auto_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def _extra_constraints(self):
        # "required" and a named function are decoded under the tools' schemas
        if self.tools and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)):
            named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
            check_tools_chars([t.function for t in self.tools], named)
            return [("tool_choice", {"tools": (self.tools_in_use(), _tool_choice_value(self.tool_choice))})]
        return []

    def chat_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


def _tool_choice_value(choice):
    return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice


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


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or messages through the chat template (with its fields as chat
    completions take them); `return_token_strs` adds each token's vocabulary string."""
    model: str | None = None
    prompt: Annotated[str, Field(max_length=4_000_000)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)] | None = None
    tools: Annotated[list[Tool], Field(fail_fast=True)] | None = None
    # the tokenizer's special tokens (BOS) added: by default to a prompt, not to rendered messages (whose
    # template writes them), as completions and chat completions each take it
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None
    documents: Annotated[list[dict[str, str]], Field(fail_fast=True)] | None = None
    return_token_strs: bool | None = False
    # vLLM's, as chat completions take them: accepted at a no-op value (`_UNSUPPORTED`)
    chat_template: Any = None
    mm_processor_kwargs: Any = None

    _function_tools_only = field_validator("tools", mode="before")(function_tools_only)
    _text_fields_only = field_validator("documents", mode="before")(text_fields_only)

    @model_validator(mode="after")
    def _one_input(self):
        _refuse_unsupported(self)
        if (self.prompt is None) == (self.messages is None):
            raise UnsupportedValue("prompt", "give exactly one of 'prompt' or 'messages'")
        if self.messages is not None:
            _check_chat_length(self.messages)
            _check_template_fields(self)
        elif self.continue_final_message or self.chat_template_kwargs or self.tools or self.documents:
            raise UnsupportedValue("prompt", "'tools', 'documents', 'continue_final_message' and "
                                             "'chat_template_kwargs' go with 'messages'")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]], Field(fail_fast=True)]
