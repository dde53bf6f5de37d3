"""The objects a sampling request's fields hold: its output constraint (`response_format`, vLLM's
`structured_outputs`), `stream_options`, `prompt_cache_options` and `prediction`."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from tokenmill.server.protocol.base import MAX_PROMPT_CHARS, UnsupportedValue, _Strict
from tokenmill.server.protocol.messages import TextPart


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


class Prediction(_Strict):
    type: Literal["content"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[TextPart], Field(fail_fast=True)]
