"""OpenAI request schemas (plus vLLM's sampling extensions) as strict pydantic models.

Unknown fields are rejected (`extra="forbid"`) and types are strict where OpenAI's schema is: no
string is read as a number, no float as an integer, no number or string as a boolean. Fields that OpenAI defines but tokenmill does not
implement are listed in `_UNSUPPORTED` and accepted only at a value that changes nothing, so that
clients which send defaults keep working while anything that would be silently ignored is a 400.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenmill.sampling_params import SamplingParams

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_PROMPTS = 256
MAX_PROMPT_CHARS = 4_000_000      # one prompt, or the text of all of a chat's messages together


class UnsupportedValue(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


def _noop_bool(v):
    return v is None or v is False


def _empty(v):
    return v is None or v == {} or v == [] or v == ""


# field -> (what value is accepted, predicate)
_UNSUPPORTED: dict[str, tuple[str, Any]] = {
    "echo": ("false", _noop_bool),
    "suffix": ("null or empty", _empty),
    "logit_bias": ("null or empty", _empty),
    "tools": ("null or empty", _empty),
    "functions": ("null or empty", _empty),
    "tool_choice": ('null or "none"', lambda v: v is None or v == "none"),
    "function_call": ('null or "none"', lambda v: v is None or v == "none"),
    "parallel_tool_calls": ("any value when no tools are given", lambda v: v is None or isinstance(v, bool)),
    "response_format": ('null or {"type": "text"}', lambda v: v is None or v == {"type": "text"}),
    "store": ("false", _noop_bool),
    "metadata": ("null or empty", _empty),
    "service_tier": ('null, "auto" or "default"', lambda v: v in (None, "auto", "default")),
    "reasoning_effort": ("null", lambda v: v is None),
    "modalities": ('null or ["text"]', lambda v: v is None or v == ["text"]),
}


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingRequest(_Strict):
    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]], Field(max_length=MAX_STOP)] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = 0

    # OpenAI fields accepted only at a no-op value (see `_UNSUPPORTED`).
    echo: Any = None
    suffix: Any = None
    logit_bias: Any = None
    best_of: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None
    modalities: Any = None

    @model_validator(mode="after")
    def _check_unsupported(self):
        for name in self.model_fields_set:
            if name in _UNSUPPORTED:
                accepted, ok = _UNSUPPORTED[name]
                value = getattr(self, name)
                try:
                    fine = ok(value)
                except Exception:
                    fine = False
                if not fine:
                    raise UnsupportedValue(name, f"'{name}' is not supported by tokenmill (only {accepted} is accepted)")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise UnsupportedValue("best_of", "'best_of' is not supported by tokenmill (only best_of == n is accepted)")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, logprobs: int | None) -> SamplingParams:
        """Build the engine's parameters; raises ValueError naming a bad value and its limit."""
        kw: dict[str, Any] = dict(
            n=self.n or 1,
            max_tokens=self.requested_max_tokens(),
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
        )
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = float(value)
        if self.top_k is not None:
            kw["top_k"] = self.top_k
        if self.seed is not None:
            kw["seed"] = self.seed % (2 ** 62)   # room for the engine's per-choice seed offsets
        return SamplingParams(**kw)


PromptType = Union[
    Annotated[str, Field(max_length=MAX_PROMPT_CHARS)],
    Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]], Field(min_length=1)],
    Annotated[list[Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]], Field(min_length=1, max_length=MAX_PROMPTS)],
    Annotated[list[Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]], Field(min_length=1)]],
              Field(min_length=1, max_length=MAX_PROMPTS)],
]


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_special_tokens: bool | None = True

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _check_chat_length(messages: list[ChatMessage] | None) -> None:
    total = sum(len(m.text()) for m in messages or ())
    if total > MAX_PROMPT_CHARS:
        raise UnsupportedValue("messages", f"The messages hold {total} characters together; the limit is "
                                           f"{MAX_PROMPT_CHARS}.")


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool | None = True

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedValue("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
        _check_chat_length(self.messages)
        return self

    def chat_messages(self) -> list[dict]:
        out = []
        for m in self.messages:
            d = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: Annotated[str, Field(max_length=4_000_000)] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise UnsupportedValue("prompt", "give exactly one of 'prompt' or 'messages'")
        _check_chat_length(self.messages)
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]
