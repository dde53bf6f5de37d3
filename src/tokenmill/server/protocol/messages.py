"""A chat's messages (their content parts and tool calls) as chat completions and /tokenize take them, how the
chat template reads them, and the checks on a chat request's template fields."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from tokenmill.server.protocol.base import MAX_PROMPT_CHARS, UnsupportedValue, _empty, _Strict, refuse_media_parts


class TextPart(_Strict):
    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


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
    "add_special_tokens": _USE_FIELD,
    "chat_template": "the chat template is the server's (--chat-template)",
    **{name: "a parameter of the template call, not a template variable" for name in (
        "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs", "self")},
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
