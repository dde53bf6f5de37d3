"""POST /v1/responses: OpenAI's Responses API over the chat path.

The request becomes a chat conversation (`instructions` first, as the system message; message,
function_call and function_call_output items as messages; an item_reference as the stored item it names),
rendered by the same template, decoded under the same constraints and parsed by the same reasoning and
tool-call parsers. The output is a list of items: a `reasoning` item (with --reasoning-parser), a `message`
with its `output_text`, and a `function_call` per tool call. A response is stored unless the request says
`store: false` (server/response_store.py): `previous_response_id` continues its conversation, an
item_reference reads one of its items, and `GET` / `DELETE /v1/responses/{id}` reach it.
"""
from __future__ import annotations

import base64
import uuid
from typing import Annotated, Any, Literal, Union

from fastapi import Request
from pydantic import (
    ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator, model_validator,
)

from tokenmill.server.chat import ChoiceText, logprob_entries, prepare_chat, reasoning_tokens
from tokenmill.server.errors import APIError, unsupported_cause
from tokenmill.server.protocol import (
    INT64_MAX, INT64_MIN, MAX_PROMPT_CHARS, PROMPT_CACHE_RETENTIONS, REASONING_EFFORTS, ChatCompletionRequest,
    Metadata, PromptCacheOptions, UnsupportedValue, _Strict, check_function_parameters, function_choice_only,
    function_tools_only, refuse_media_parts,
)
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.serving import Serving, now

# ----- the request -------------------------------------------------------------------------------


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
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[InputText]
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
    output: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[InputText]
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
        for parts in (self.content, _unwrap(self.encrypted_content), self.summary):
            if isinstance(parts, str):
                return parts
            if not isinstance(parts, list):      # absent, or a shape no client sends: nothing to read
                continue
            texts = [p.get("text") for p in parts if isinstance(p, dict)]
            if texts and all(isinstance(t, str) for t in texts):
                return "".join(texts)
        return ""


# `include: ["reasoning.encrypted_content"]` (what Codex and the Agents SDK send with `store: false`, to
# carry reasoning between turns themselves): reasoning items then carry their text in `encrypted_content`.
# It is encoded, not encrypted (this server holds no key and the text is in the item's content already);
# the prefix tells a blob of ours from another server's, which is ignored.
INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs")
_BLOB_PREFIX = "tokenmill-reasoning-v1."


def _wrap(text: str) -> str:
    return _BLOB_PREFIX + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def _unwrap(blob) -> str | None:
    if not isinstance(blob, str) or not blob.startswith(_BLOB_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(blob[len(_BLOB_PREFIX):]).decode("utf-8")
    except ValueError:
        return None


class ItemReference(_Strict):
    """An item of a stored response (its request's input or its output) named by id instead of sent again;
    OpenAI's type is optional, so an item of nothing but an id is one too. `resolve_references` replaces it
    with the stored item before the request is read."""
    type: Literal["item_reference"] | None = None
    id: str


_ITEM_ID_PREFIX = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


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
_ITEMS = TypeAdapter(list[InputItem])
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
    input: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
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
    include: list[str] | None = None
    background: bool | None = None      # a strict bool: Literal[False] let 0 and 0.0 through as false
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
                raise UnsupportedValue("input", f"input item type {kind!r} is not supported by tokenmill (only "
                                                f"{', '.join(map(repr, ITEM_TYPES))})")
        return items

    _function_tools_only = field_validator("tools", mode="before")(function_tools_only)
    _function_choice_only = field_validator("tool_choice", mode="before")(function_choice_only)

    @model_validator(mode="after")
    def _check(self):
        if self.background:
            raise UnsupportedValue("background", "'background' is not supported by tokenmill: a response is "
                                                 "answered in its request (set it false or leave it out)")
        if self.conversation is not None:
            raise UnsupportedValue("conversation", f"'conversation' ({repr(self.conversation)[:100]}) is not supported "
                                                   "by tokenmill: it has no Conversations API (continue a response "
                                                   "with 'previous_response_id', or send the conversation as 'input')")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedValue("stream_options", "'stream_options' is only allowed when 'stream' is true")
        unknown = [v for v in self.include or () if v not in INCLUDES]
        if unknown:
            raise UnsupportedValue("include", f"'include' value {unknown[0]!r} is not supported by tokenmill "
                                              f"(only {', '.join(map(repr, INCLUDES))})")
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
        earlier = _ITEMS.validate_python(list(history)) if history else []
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
                raise APIError(400, f"Duplicate item found with id {item.id!r}: {why}", "input")
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
                                        f"{item.call_id!r}: no function_call item in the input or the "
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


# ----- the response ------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(shape: _Shape, text: ChoiceText, whole: str, logprobs: list[dict], cut: bool = False) -> list[dict]:
    """A response's output items from its whole text, as the streamed response's completed event holds
    them (the text one delta), so that text around a tool call makes the same messages either way;
    `logprobs` (the output's tokens') go with the first message's text; `cut`: max_output_tokens ended
    the output, so its last item is incomplete."""
    events = _EventStream(shape)
    events.pending_logprobs = logprobs
    for part in (text.feed(whole) if whole else []) + text.finish():
        events.delta(part)
    events.close_all(cut)
    return events.items


def _encrypted(item: dict, include: list[str] | None) -> dict:
    """A reasoning item with `encrypted_content` where the request included it."""
    if include and "reasoning.encrypted_content" in include:
        item["encrypted_content"] = _wrap(item["content"][0]["text"])
    return item


class _Shape:
    """The response object's fixed fields, for the final body and for every event that carries it."""

    def __init__(self, serving: Serving, req: ResponsesRequest, model: str, stored: bool, prompt_text: str, params):
        self.id, self.created, self.req, self.model = _id("resp"), now(), req, model
        self.serving, self.stored = serving, stored
        self.prompt_text = prompt_text        # where the output starts, for its reasoning tokens' count
        self.params = params                  # the sampling parameters, the server's defaults filled in

    def body(self, status: str, output: list[dict], out=None, finish: str | None = None) -> dict:
        r = self.req
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else {
            "type": "text"}
        # OpenAI's spelling of the retention this server also takes as "in-memory"
        retention = r.prompt_cache_retention.replace("-", "_") if r.prompt_cache_retention else None
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "completed_at": now() if status == "completed" else None, "background": False,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                # the values sampled with, as OpenAI's and vLLM's responses give them (1.0 where neither the
                # request nor the model's generation config sets one)
                "temperature": self.params.temperature, "top_p": self.params.top_p, "top_logprobs": r.top_logprobs,
                "parallel_tool_calls": r.parallel_tool_calls is not False, "max_tool_calls": r.max_tool_calls,
                "tool_choice": (r.tool_choice.model_dump() if isinstance(r.tool_choice, NamedFunctionChoice)
                                else r.tool_choice or "auto"),
                "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
                "text": {"format": fmt}, "reasoning": r.reasoning.model_dump() if r.reasoning else None,
                "store": self.stored, "previous_response_id": r.previous_response_id, "metadata": r.metadata or {},
                "truncation": r.truncation or "disabled", "user": r.user, "service_tier": "default",
                "prompt_cache_key": r.prompt_cache_key, "prompt_cache_retention": retention,
                "safety_identifier": r.safety_identifier, "usage": None}
        if out is not None:
            prompt = len(out.prompt_token_ids)
            completion = sum(len(c.token_ids) for c in out.outputs)
            reasoning = reasoning_tokens(self.serving, self.prompt_text, out.outputs) or 0
            body["usage"] = {"input_tokens": prompt,
                             "input_tokens_details": {"cached_tokens": out.num_cached_tokens or 0},
                             "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
                             "total_tokens": prompt + completion}
        return body


def response_store(serving: Serving, param: str) -> ResponseStore:
    """The process's store; with several API server processes there is none (a 400 naming `param`)."""
    if serving.responses is None:
        raise APIError(400, "responses are not stored with --api-server-count above 1 (a later request may reach "
                       "another API server process): send the whole conversation as 'input'", param)
    return serving.responses


def resolve_references(serving: Serving, req: ResponsesRequest) -> ResponsesRequest:
    """`req` with each item_reference in its input replaced by the stored item it names, which then reaches the
    prompt, the duplicate check against previous_response_id's conversation and the stored input as if sent."""
    if not isinstance(req.input, list):
        return req
    refs = [item.id for item in req.input if isinstance(item, ItemReference)]
    if not refs:
        return req
    if serving.responses is None:
        raise APIError(400, f"Item with id {refs[0]!r} not found: responses are not stored with --api-server-count "
                            "above 1 (a later request may reach another API server process); send the item "
                            "itself instead of an item_reference", "input")
    found = serving.responses.items(refs)
    try:
        resolved = iter(_ITEMS.validate_python([found[ref] for ref in refs]))
    except ValidationError as e:
        raise APIError(400, f"input: a referenced item cannot be read back: {e}", "input") from None
    items = [next(resolved) if isinstance(item, ItemReference) else item for item in req.input]
    return req.model_copy(update={"input": items})


def list_page(items: list[dict], limit: int, order: str, after: str | None) -> dict:
    """OpenAI's cursor page over `items` (oldest first): `limit` (1-100) of them in `order` ("asc" oldest
    first, "desc" newest first), starting after the item whose id is `after`."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be between 1 and 100, got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", "order")
    if order == "desc":
        items = items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise APIError(400, f"after: no item with id {after!r} in this list", "after")
        start = ids.index(after) + 1
    page = items[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}


async def prepare(serving: Serving, req: ResponsesRequest, history: list[dict]):
    """The request as a chat request, and that request's prompt text, prompt and sampling parameters. With
    truncation "auto", where the prompt does not fit the context (with room for max_output_tokens), the fewest
    of the conversation's earliest items are dropped that make it fit (OpenAI's rule; the instructions stay),
    found by bisection: dropping more never lengthens the prompt. Where even the last item alone does not
    fit, the 400 is the whole conversation's."""
    async def prepared(drop: int = 0):
        chat = req.as_chat(bool(req.stream), history, drop)
        return chat, *await prepare_chat(serving, chat, effort_param="reasoning.effort")

    try:
        return await prepared()
    except APIError as e:
        if req.truncation != "auto" or e.code != "context_length_exceeded":
            raise
        too_long = e
    # at most up to the last message or call, so that the conversation left has one
    kinds = [item["type"] for item in history] + (
        [item.type or "message" for item in req.input] if isinstance(req.input, list) else ["message"])
    fits, low, high = None, 1, max((i for i, kind in enumerate(kinds) if kind in ("message", "function_call")),
                                   default=0)
    while low <= high:
        drop = (low + high) // 2
        try:
            fits = await prepared(drop)
            high = drop - 1
        except APIError as e:
            if e.code != "context_length_exceeded":
                raise
            low = drop + 1
    if fits is None:
        too_long.message += " With truncation 'auto', even the conversation's last item alone does not fit."
        raise too_long
    return fits


async def create_response(serving: Serving, req: ResponsesRequest, raw: Request):
    serving.check_model(req.model)
    req = resolve_references(serving, req)
    history = []
    if req.previous_response_id is not None:
        history = response_store(serving, "previous_response_id").conversation(req.previous_response_id)
    try:
        chat, prompt_text, prompt, params = await prepare(serving, req, history)
    except APIError as e:
        e.param = req.field_of(e.param)
        raise
    keep = serving.responses is not None and req.store is not False
    shape = _Shape(serving, req, req.model or serving.model_names[0], keep, prompt_text, params)
    # made once: the ids given to items that came without one are the same while a stream runs and after
    input_items = req.input_items() if keep else []

    def done(body: dict) -> dict:
        if keep:
            serving.responses.put(body, input_items) if not req.stream else \
                serving.responses.update(body, input_items)
        return body

    # the request has no return_tokens_as_token_ids of its own: the server's (--return-tokens-as-token-ids)
    k, as_ids = params.logprobs, serving.tokens_as_ids(chat)

    def token_logprobs(token_ids, entries) -> list[dict]:
        return logprob_entries(serving, token_ids, entries, k, as_ids) if k is not None and entries is not None \
            else []

    def final(outs):
        out = outs[0]
        c = out.outputs[0]
        items = output_items(shape, ChoiceText(serving, chat, prompt_text), c.text,
                             token_logprobs(c.token_ids, c.logprobs), c.finish_reason == "length")
        status = "incomplete" if c.finish_reason == "length" else "completed"
        return shape.body(status, items, out, c.finish_reason)

    async def stream(merged):
        if keep:
            serving.responses.put(shape.body("in_progress", []), input_items)
        try:
            async for e in stream_events(merged):
                yield e
        finally:
            if keep and serving.responses.in_progress(shape.id):    # failed, or cut by the client
                serving.responses.discard(shape.id)

    async def stream_events(merged):
        events = _EventStream(shape)
        yield events.event("response.created", response=shape.body("in_progress", []))
        yield events.event("response.in_progress", response=shape.body("in_progress", []))
        text = ChoiceText(serving, chat, prompt_text)
        sent = sent_tokens = 0
        last = None
        async for _, out in merged:
            last = out
            c = out.outputs[0]
            piece = c.text[sent:]
            sent = len(c.text)
            events.pending_logprobs += token_logprobs(c.token_ids[sent_tokens:],
                                                      c.logprobs[sent_tokens:] if c.logprobs is not None else None)
            sent_tokens = len(c.token_ids)
            parts = text.feed(piece) if piece else []
            if c.finish_reason is not None:
                parts += text.finish()
            for part in parts:
                for e in events.delta(part):
                    yield e
        c = last.outputs[0]
        for e in events.close_all(c.finish_reason == "length"):
            yield e
        status = "incomplete" if c.finish_reason == "length" else "completed"
        yield events.event("response.completed" if status == "completed" else "response.incomplete",
                           response=done(shape.body(status, events.items, last, c.finish_reason)))

    serving.admit()
    return await serving.run(raw, [prompt], params, req.priority or 0, bool(req.stream), stream, final,
                             event_names=True, field_of=lambda param: req.field_of(chat.field_of(param)),
                             carries_tools=bool(req.tools), keep_final=done)


class _EventStream:
    """Responses' streaming events, each with its sequence number: an item is added, its deltas
    follow, and it is done before the next item opens."""

    def __init__(self, shape: _Shape):
        self.shape = shape
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None       # the item receiving deltas
        self.calls: dict[int, dict] = {}    # streamed tool-call index -> its item
        self.pending_logprobs: list[dict] = []   # tokens' logprobs not yet sent with an output_text delta

    def event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def _start(self, item: dict) -> list[dict]:
        events = self._close()
        self.open = item
        self.items.append(item)
        # a message or reasoning item opens with its content list empty, as OpenAI's do (the SDK's stream
        # helpers append the parts that follow to it)
        opened = {**item, "status": "in_progress"}
        if item["type"] in ("message", "reasoning"):
            opened["content"] = []
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=opened))
        if item["type"] in ("message", "reasoning"):
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} if item["type"] == "message" else \
                {"type": "reasoning_text", "text": ""}
            item["content"] = [dict(part)]
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0, part=part))
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=part["logprobs"]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["content"][0]["text"]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=item["content"][0]))
            _encrypted(item, self.shape.req.include)
        elif item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def delta(self, part: dict) -> list[dict]:
        events = []
        if "reasoning_content" in part:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start({"type": "reasoning", "id": _id("rs"), "summary": []})
            self.open["content"][0]["text"] += part["reasoning_content"]
            events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                     output_index=len(self.items) - 1, content_index=0,
                                     delta=part["reasoning_content"]))
        if part.get("content"):
            if self.open is None or self.open["type"] != "message":
                events += self._start({"type": "message", "id": _id("msg"), "role": "assistant"})
            self.open["content"][0]["text"] += part["content"]
            lps, self.pending_logprobs = self.pending_logprobs, []
            self.open["content"][0]["logprobs"] += lps
            events.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=len(self.items) - 1, content_index=0, delta=part["content"],
                                     logprobs=lps))
        for call in part.get("tool_calls") or ():
            item = self.calls.get(call["index"])
            if item is None:
                fn = call.get("function", {})
                item = {"type": "function_call", "id": _id("fc"), "call_id": call.get("id") or _id("call"),
                        "name": fn.get("name", ""), "arguments": ""}
                self.calls[call["index"]] = item
                events += self._start(item)
            args = call.get("function", {}).get("arguments") or ""
            if args:
                item["arguments"] += args
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self.items.index(item), delta=args))
        return events

    def close_all(self, cut: bool = False) -> list[dict]:
        """The last item's done events (its status "incomplete" where `cut`: max_output_tokens ended the output within
        it, as OpenAI marks it, so that an agent does not run a call cut short). Tokens after the last text
        delta (the end-of-sequence token, a trailing tool call's) go with the message's text, as in the
        response that is not streamed: in its output_text.done while it is open, and in the completed
        response's items either way."""
        message = next((item for item in reversed(self.items) if item["type"] == "message"), None)
        if message is not None and self.pending_logprobs:
            message["content"][0]["logprobs"] += self.pending_logprobs
            self.pending_logprobs = []
        return self._close("incomplete" if cut else "completed")
