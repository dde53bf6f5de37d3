"""/v1/completions' request: a prompt (a string, token ids, or a batch of either) and the completion fields."""
from __future__ import annotations

from typing import Annotated, ClassVar, Union

from pydantic import Field, ValidationError, field_validator, model_validator

from tokenmill.server.protocol.base import INT64_MAX, MAX_LOGPROBS, MAX_PROMPT_CHARS, MAX_PROMPTS, UnsupportedValue
from tokenmill.server.protocol.sampling import _SamplingRequest


COMPLETION_MAX_TOKENS = 16       # OpenAI's default max_tokens for completions


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
