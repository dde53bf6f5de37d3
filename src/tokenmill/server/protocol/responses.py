"""POST /v1/responses' request: its tools, tool_choice, text and reasoning options, and `ResponsesRequest`, which
reads as the chat request (`as_chat`) that its handler (server/responses.py) serves, and lists its input as stored
items. Its input items are in response_items.py, its `include` values in response_includes.py.

Not re-exported by the package: `as_chat` raises server/errors.py's `APIError`, and errors.py imports the
package, so the package importing this module would make the two import each other.
"""
from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from tokenmill.sampling_params import shown
from tokenmill.server.errors import APIError, unsupported_cause
from tokenmill.server.protocol.base import (
    INT64_MAX, INT64_MIN, MAX_PROMPT_CHARS, PROMPT_CACHE_RETENTIONS, REASONING_EFFORTS, Metadata, UnsupportedValue,
    _Strict,
)
from tokenmill.server.protocol.chat import ChatCompletionRequest
from tokenmill.server.protocol.options import PromptCacheOptions
from tokenmill.server.protocol.response_includes import INCLUDE_LOGPROBS, INCLUDES, unknown_include
from tokenmill.server.protocol.response_items import (
    INPUT_ITEMS, ITEM_TYPES, FunctionCallItem, FunctionCallOutputItem, InputItem, ItemReference, MessageItem,
    ReasoningItem,
)
from tokenmill.server.protocol.tools import check_function_parameters, function_choice_only, function_tools_only


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_ITEM_ID_PREFIX = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}

# the chat request's fields (`ResponsesRequest.as_chat`) that this API calls otherwise
_RESPONSES_FIELDS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "prompt": "input",
                     "messages": "input", "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _check_parameters = field_validator("parameters")(check_function_parameters)


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise UnsupportedValue("text.format.schema", "text.format of type 'json_schema' needs 'schema'")
        return self


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesStreamOptions(_Strict):
    # OpenAI's padding of streamed events against length side channels: this server adds none
    include_obfuscation: bool | None = None


class ReasoningOptions(_Strict):
    effort: REASONING_EFFORTS | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Any = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[InputItem], Field(min_length=1,
                                                                                                  fail_fast=True)]
    instructions: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Annotated[list[FunctionTool], Field(fail_fast=True)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's bound on calls to its built-in tools, which this server runs none of: it bounds nothing here
    max_tool_calls: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: Metadata | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: PROMPT_CACHE_RETENTIONS | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    # OpenAI's Conversations API, which this server has none of: null alone (`_check`)
    conversation: Any = None
    # "auto": the conversation's earliest items are dropped until the prompt fits (`prepare`)
    truncation: Literal["auto", "disabled"] | None = None
    include: Annotated[list[str], Field(fail_fast=True)] | None = None
    background: bool | None = None      # strict: 0 and 0.0 are no bools
    # vLLM's extra field, as chat's: lower is served first under --scheduling-policy priority (a 400 otherwise)
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = 0
    # vLLM's, as chat's: prefix-cache blocks are shared only among requests of one salt
    cache_salt: Annotated[str, Field(min_length=1)] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_item_types(cls, items):
        """A 400 naming an item type this server does not read (OpenAI's built-in tools' calls), rather than
        one listing the fields a message would need."""
        for item in items if isinstance(items, list) else ():
            kind = item.get("type") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in ITEM_TYPES:
                raise UnsupportedValue("input", f"input item type {shown(kind)} is not supported by tokenmill (only "
                                                f"{', '.join(map(repr, ITEM_TYPES))})")
        return items

    _function_tools_only = field_validator("tools", mode="before")(function_tools_only)
    _function_choice_only = field_validator("tool_choice", mode="before")(function_choice_only)

    @model_validator(mode="after")
    def _check(self):
        if self.background and self.store is False:
            raise UnsupportedValue("background", "'background' true needs 'store' true (a background response "
                                                 "is read back from the store): leave 'store' out or set it true")
        if self.conversation is not None:
            raise UnsupportedValue("conversation", f"'conversation' ({shown(self.conversation)}) is not supported "
                                                   "by tokenmill: it has no Conversations API (continue a response "
                                                   "with 'previous_response_id', or send the conversation as 'input')")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedValue("stream_options", "'stream_options' is only allowed when 'stream' is true")
        unknown = unknown_include(self.include)
        if unknown:
            raise UnsupportedValue("include", unknown)
        return self

    def field_of(self, param: str | None) -> str | None:
        """This request's field for a chat request's (`as_chat`), as an error names it."""
        if param == "structured_outputs.json":        # a schema that does not compile: the format's or a tool's
            fmt = self.text.format if self.text is not None else None
            return "text.format" if fmt is not None and fmt.type == "json_schema" else "tools"
        return _RESPONSES_FIELDS.get(param, param)

    def wants_logprobs(self) -> bool:
        """The output text's token logprobs: asked by include (OpenAI's way) or by top_logprobs alone."""
        return "message.output_text.logprobs" in (self.include or ()) or self.top_logprobs is not None

    def included(self) -> list[str]:
        """The `include` values its response's output carries (as stored, for GET's `include`): those asked, and
        the output text's logprobs where top_logprobs alone asks for them."""
        return [v for v in INCLUDES if v in (self.include or ()) or v == INCLUDE_LOGPROBS and self.wants_logprobs()]

    def input_items(self) -> list[dict]:
        """The input as items, as a stored response keeps them and `input_items` lists them: each with
        an id (the client's, or a new one) and a status, a message's text as content parts."""
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        out = []
        for item in items:
            d = item.model_dump(exclude_none=True)
            d.setdefault("id", _id(_ITEM_ID_PREFIX.get(d.get("type"), "msg")))
            d.setdefault("status", "completed")
            if isinstance(item, MessageItem):
                d["type"] = "message"
                if isinstance(item.content, str):
                    part = "output_text" if item.role == "assistant" else "input_text"
                    d["content"] = [{"type": part, "text": item.content}]
            out.append(d)
        return out

    def as_chat(self, stream: bool, history: list[dict] = (), drop: int = 0) -> ChatCompletionRequest:
        """The same request as chat completions see it, after the items of `history` (the conversation of
        `previous_response_id`); `drop`: the conversation's first items left out (truncation "auto"), with the
        outputs of the calls among them."""
        messages: list[dict] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        thinking = ""           # reasoning items' text, for the next assistant message
        earlier = INPUT_ITEMS.validate_python(list(history)) if history else []
        # an item of the conversation sent again, or twice in the input, would reach the prompt twice (OpenAI's
        # API refuses both too)
        stored = {item.id for item in earlier if item.id is not None}
        seen = set(stored)
        for item in items:
            if item.id is None:
                continue
            if item.id in seen:
                why = ("the conversation of previous_response_id holds it already (send only the items that follow "
                       "it)") if item.id in stored else "the input holds it twice"
                raise APIError(400, f"Duplicate item found with id {shown(item.id)}: {why}", "input")
            seen.add(item.id)
        items = earlier + list(items)
        if any(isinstance(item, ItemReference) for item in items):
            raise TypeError("item references are resolved (resolve_references) before the request is read")
        calls = {item.call_id for item in items if isinstance(item, FunctionCallItem)}
        if drop:
            dropped = calls - {item.call_id for item in items[drop:] if isinstance(item, FunctionCallItem)}
            calls -= dropped
            items = [item for item in items[drop:]
                     if not (isinstance(item, FunctionCallOutputItem) and item.call_id in dropped)]
        for item in items:
            if isinstance(item, ReasoningItem):
                thinking += item.text()
                continue
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                # a call joins the assistant message before it (its text, or the calls before it): one turn
                # of the model's, as it wrote it and as chat completions keep it
                if messages and messages[-1]["role"] == "assistant" and not thinking:
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                if item.call_id not in calls:
                    raise APIError(400, f"No tool call found for function call output with call_id "
                                        f"{shown(item.call_id)}: no function_call item in the input or the "
                                        "conversation has it", "input")
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            if thinking and messages[-1]["role"] == "assistant":
                messages[-1]["reasoning_content"] = thinking
            thinking = ""
        if not messages:
            raise APIError(400, "input holds no message, function_call or function_call_output item (reasoning "
                                "items alone make no conversation)", "input")
        body: dict[str, Any] = {"messages": messages, "stream": stream, "max_tokens": self.max_output_tokens}
        for name in ("model", "temperature", "top_p", "parallel_tool_calls", "user", "metadata",
                     "prompt_cache_key", "safety_identifier", "cache_salt"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                             for t in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.wants_logprobs():
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
        try:
            return ChatCompletionRequest.model_validate(body)
        except UnsupportedValue as e:
            raise APIError(400, str(e), e.field) from None
        except ValidationError as e:
            # a check of the chat request's (a tool_choice naming no tool, ...): its own message and field
            cause = unsupported_cause(e.errors())
            if cause is not None:
                raise APIError(400, str(cause), cause.field) from None
            raise APIError(400, f"input: {e}", "input") from None
        except ValueError as e:
            raise APIError(400, f"input: {e}", "input") from None
