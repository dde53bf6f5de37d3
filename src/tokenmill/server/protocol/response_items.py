"""The input items of a Responses request (messages, function calls and their outputs, reasoning items, item
references), each validated as the kind its type names; `INPUT_ITEMS` reads a list of them back from the store."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, field_validator

from tokenmill.server.protocol.base import MAX_PROMPT_CHARS, _Strict, refuse_media_parts
from tokenmill.server.protocol.response_includes import unwrap_reasoning


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
    annotations: Any = None
    logprobs: Any = None
    # the openai client's responses.parse() keeps the text it parsed beside it: the same data, not kept
    parsed: Any = Field(default=None, exclude=True)
    # the client's field that this server's items leave out: null where a client sends back an item of
    # `input_items.list` as the client dumps it
    prompt_cache_breakpoint: None = None


def _joined(text: str | list[InputText]) -> str:
    """A text given as a string or as input_text parts: the parts' text joined."""
    return text if isinstance(text, str) else "".join(p.text for p in text)


class MessageItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[InputText], Field(fail_fast=True)]
    id: str | None = None
    status: str | None = None
    # the openai client's fields that this server's output items leave out: null where a client sends back
    # an item as the client dumps it (`model_dump()`)
    phase: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        return refuse_media_parts(content, "input.content")

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    # as in MessageItem: the client's fields, null in the items it dumps from this server's output (`async`
    # under its name in the client's model, as `model_dump()` without by_alias writes it)
    async_: None = Field(default=None, alias="async")
    caller: None = None
    namespace: None = None
    created_by: None = None
    # the openai client's responses.parse() keeps the arguments it parsed beside them: the same data, not kept
    parsed_arguments: Any = Field(default=None, exclude=True)

    model_config = ConfigDict(populate_by_name=True)


class FunctionCallOutputItem(_Strict):
    """A tool's result: a string, or content parts as OpenAI's API also takes them (what the Agents SDK sends
    for a tool that returns text objects); the parts' text joined is what the model sees."""
    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[InputText], Field(fail_fast=True)]
    id: str | None = None
    status: str | None = None
    # as in MessageItem: the client's fields, null in the items of `input_items.list` as it dumps them
    caller: None = None
    created_by: None = None
    name: None = None
    namespace: None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, output):
        return refuse_media_parts(output, "input.output")

    def text(self) -> str:
        return _joined(self.output)


class ReasoningItem(_Strict):
    """A reasoning item sent back from an earlier response: its text becomes the `reasoning_content` of
    the assistant message that follows it, for the chat template to keep or drop (Qwen3's keeps the
    thinking of the turn in progress, between tool calls, and drops that of earlier turns)."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: Any = None
    content: Any = None
    encrypted_content: Any = None
    status: str | None = None

    def text(self) -> str:
        """The reasoning text: its content parts', else what `encrypted_content` carries if this server
        wrote it, else its summary's; "" where none is readable."""
        for parts in (self.content, unwrap_reasoning(self.encrypted_content), self.summary):
            if isinstance(parts, str):
                return parts
            if not isinstance(parts, list):      # absent, or a shape no client sends: nothing to read
                continue
            texts = [p.get("text") for p in parts if isinstance(p, dict)]
            if texts and all(isinstance(t, str) for t in texts):
                return "".join(texts)
        return ""


class ItemReference(_Strict):
    """An item of a stored response (its request's input or its output) named by id instead of sent again;
    OpenAI's type is optional, so an item of nothing but an id is one too. `resolve_references` replaces it
    with the stored item before the request is read."""
    type: Literal["item_reference"] | None = None
    id: str


# the input item types this server reads; a message may also leave its type out
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "item_reference")
_ITEM_CLASSES = {"function_call": "FunctionCallItem", "function_call_output": "FunctionCallOutputItem",
                 "reasoning": "ReasoningItem", "item_reference": "ItemReference"}


def _item_kind(item) -> str:
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    if kind is None and isinstance(item, dict) and "id" in item and item.keys() <= {"id", "type"}:
        return "ItemReference"
    return _ITEM_CLASSES.get(kind, "MessageItem")


# an item is validated as the kind its type names (a message where it names none), so that a bad item's 400
# speaks of that kind's fields only; the tags are class names, which an error's field path leaves out
# (errors._field_path), so that it names the client's fields ("input.0.name", not "input.0.message.name")
InputItem = Annotated[Union[Annotated[FunctionCallItem, Tag("FunctionCallItem")],
                            Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")],
                            Annotated[ReasoningItem, Tag("ReasoningItem")],
                            Annotated[ItemReference, Tag("ItemReference")],
                            Annotated[MessageItem, Tag("MessageItem")]], Discriminator(_item_kind)]
INPUT_ITEMS = TypeAdapter(list[InputItem])
