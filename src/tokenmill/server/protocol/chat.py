"""/v1/chat/completions' request: messages, tools and tool_choice, the chat template's fields and reasoning."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from tokenmill.sampling_params import shown
from tokenmill.server.protocol.base import (MAX_LOGPROBS, MAX_TEMPLATE_KWARGS, REASONING_EFFORTS, UnsupportedValue,
                                            text_fields_only)
from tokenmill.server.protocol.messages import ChatMessage, _check_chat_length, _check_template_fields
from tokenmill.server.protocol.sampling import _SamplingRequest
from tokenmill.server.protocol.tools import (NamedToolChoice, Tool, _tool_choice_value, check_tools_chars,
                                             function_choice_only, function_tools_only)


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
