"""vLLM's /tokenize and /detokenize requests."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from tokenmill.server.protocol.base import (INT64_MAX, MAX_TEMPLATE_KWARGS, UnsupportedValue, _refuse_unsupported,
                                            _Strict, text_fields_only)
from tokenmill.server.protocol.messages import ChatMessage, _check_chat_length, _check_template_fields
from tokenmill.server.protocol.tools import Tool, function_tools_only


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
