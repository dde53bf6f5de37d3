"""Responses' streaming events (server/response_output.py `_EventStream`): every output token's logprob reaches
the message's text, as in the response that is not streamed, those of tokens after the last text delta
included; an output cut short ends in an incomplete item. And the request's items as the chat messages
they become (`ResponsesRequest.as_chat`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from tokenmill.server.errors import APIError
from tokenmill.server.protocol.response_includes import unwrap_reasoning
from tokenmill.server.protocol.responses import ResponsesRequest
from tokenmill.server.response_output import _EventStream
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.responses import resolve_references, retrieve


def _lp(token: str) -> dict:
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}


def test_tokens_after_the_last_text_delta_keep_their_logprobs():
    """The end-of-sequence token adds no text, so no delta carries its logprob: the message's
    output_text.done and the completed response's item do."""
    events = _EventStream(shape=None)
    events.pending_logprobs += [_lp("Hi")]
    deltas = events.delta({"content": "Hi"})
    events.pending_logprobs += [_lp("")]
    done = events.close_all()
    assert [e["logprobs"] for e in deltas if e["type"] == "response.output_text.delta"] == [[_lp("Hi")]]
    text_done = next(e for e in done if e["type"] == "response.output_text.done")
    assert text_done["logprobs"] == [_lp("Hi"), _lp("")]
    assert events.items[0]["content"][0]["logprobs"] == [_lp("Hi"), _lp("")]
    assert events.pending_logprobs == []


def test_a_message_closed_by_a_tool_call_takes_the_trailing_logprobs():
    """Text, then a tool call that closes the message: the call's tokens' logprobs go with the message's
    text in the completed response, as unstreamed; the message's done event had gone out before them."""
    events = _EventStream(shape=None)
    events.pending_logprobs += [_lp("a")]
    events.delta({"content": "a"})
    events.pending_logprobs += [_lp("<tool_call>"), _lp("{")]
    opened = events.delta({"tool_calls": [{"index": 0, "id": "call_1",
                                            "function": {"name": "f", "arguments": "{}"}}]})
    assert next(e for e in opened if e["type"] == "response.output_text.done")["logprobs"] == [_lp("a")]
    events.close_all()
    message, call = events.items
    assert call["type"] == "function_call" and call["arguments"] == "{}"
    assert message["content"][0]["logprobs"] == [_lp("a"), _lp("<tool_call>"), _lp("{")]


def test_no_message_no_logprobs_kept():
    """Only a tool call: there is no text to carry logprobs, as unstreamed."""
    events = _EventStream(shape=None)
    events.pending_logprobs += [_lp("<tool_call>")]
    events.delta({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{}"}}]})
    events.close_all()
    assert [item["type"] for item in events.items] == ["function_call"]


def test_an_output_cut_by_max_output_tokens_leaves_its_last_item_incomplete():
    """A call cut short is marked incomplete (an agent must not run it); the items before it completed."""
    events = _EventStream(shape=None)
    events.delta({"content": "Let me check."})
    events.delta({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": '{"ci'}}]})
    done = events.close_all(cut=True)
    assert [item["status"] for item in events.items] == ["completed", "incomplete"]
    assert next(e for e in done if e["type"] == "response.output_item.done")["item"]["status"] == "incomplete"


def test_reasoning_text_comes_in_a_content_part_as_the_messages_text_does():
    """OpenAI's event order, the reasoning item's as the message's (vLLM's too): the item added, its
    reasoning_text part added, the deltas, the text done, the part done, the item done."""
    events = _EventStream(shape=SimpleNamespace(req=SimpleNamespace(include=None)))
    sent = events.delta({"reasoning_content": "Hm."}) + events.delta({"content": "Hi"}) + events.close_all()
    assert [(e["type"], e.get("output_index")) for e in sent] == [
        ("response.output_item.added", 0), ("response.content_part.added", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1), ("response.output_text.delta", 1),
        ("response.output_text.done", 1), ("response.content_part.done", 1), ("response.output_item.done", 1)]
    assert sent[1]["part"] == {"type": "reasoning_text", "text": ""} and sent[1]["content_index"] == 0
    assert sent[4]["part"] == {"type": "reasoning_text", "text": "Hm."} and sent[4]["item_id"] == sent[0]["item"]["id"]
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))


def test_a_long_output_is_held_in_pieces_until_its_item_closes():
    """An open item's text or a call's arguments grew by each delta (the string copied whole each time: a
    100,000-delta message took seconds of the event loop); they are kept as their deltas and joined once, as
    the item closes, and the done events and items carry them whole."""
    events = _EventStream(shape=SimpleNamespace(req=SimpleNamespace(include=None)))
    for i in range(20_000):
        events.delta({"reasoning_content": f"r{i} "})
    for i in range(20_000):
        events.delta({"content": f"c{i} "})
        assert events.open["content"][0]["text"] == ""
    events.delta({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "["}}]})
    for i in range(20_000):
        events.delta({"tool_calls": [{"index": 0, "function": {"arguments": f"{i}, "}}]})
        assert events.open["arguments"] == ""
    done = events.close_all()
    assert events.items[0]["content"][0]["text"] == "".join(f"r{i} " for i in range(20_000))
    message = "".join(f"c{i} " for i in range(20_000))
    assert events.items[1]["content"][0]["text"] == message
    assert [e["text"] for e in done if e["type"] == "response.output_text.done"] == []
    arguments = "[" + "".join(f"{i}, " for i in range(20_000))
    assert events.items[2]["arguments"] == arguments
    assert next(e for e in done if e["type"] == "response.function_call_arguments.done")["arguments"] == arguments


def _chat(items: list[dict]) -> list[dict]:
    return ResponsesRequest.model_validate({"input": items}).as_chat(False).chat_messages()


def test_text_then_a_call_is_one_assistant_turn():
    """The model's turn [message, function_call] goes back to the template as it wrote it: one
    assistant message with its text and its call (as chat completions keep it), not two turns."""
    messages = _chat([
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "Let me check."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1"]


def test_a_function_call_output_may_be_content_parts():
    """OpenAI's API takes a tool's output as input_text parts as well as a string (the Agents SDK sends
    them): the tool message holds their text; a media part is refused by name."""
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    parts = [{"type": "input_text", "text": "18 "}, {"type": "input_text", "text": "C"}]
    messages = _chat([{"role": "user", "content": "weather?"}, call,
                      {"type": "function_call_output", "call_id": "c1", "output": parts}])
    assert messages[-1]["role"] == "tool" and messages[-1]["content"] == "18 C"
    with pytest.raises(ValidationError, match="'input_image' content is not supported"):
        _chat([call, {"type": "function_call_output", "call_id": "c1",
                      "output": [{"type": "input_image", "image_url": "https://x/y.png"}]}])


def test_output_items_sent_back_as_the_openai_client_dumps_them():
    """`item.model_dump()` of the client's output items carries its fields this server leaves out, as
    null (a message's phase; a call's async, caller and namespace): accepted, and not stored back."""
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage
    message = ResponseOutputMessage.model_validate({
        "type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]})
    call = ResponseFunctionToolCall.model_validate({"type": "function_call", "id": "fc_1", "call_id": "c1",
                                                    "name": "f", "arguments": "{}", "status": "completed"})
    items = [{"role": "user", "content": "hi"}, message.model_dump(mode="json", by_alias=True),
             call.model_dump(mode="json", by_alias=True), {"type": "function_call_output", "call_id": "c1", "output": "x"}]
    assert {"phase", "async", "namespace"} <= set(items[1]) | set(items[2])
    assert [m["role"] for m in _chat(items)] == ["user", "assistant", "tool"]
    stored = ResponsesRequest.model_validate({"input": items}).input_items()
    assert not {"phase", "async", "async_", "caller", "namespace"} & (set(stored[1]) | set(stored[2]))
    with pytest.raises(ValidationError, match="namespace"):
        _chat([{**items[2], "namespace": "ns"}])


def test_output_items_of_the_clients_parse_helper_dumped_without_aliases():
    """`responses.parse()` keeps what it parsed beside the text (an output_text's `parsed`, a call's
    `parsed_arguments`), and `model_dump()` without by_alias writes a call's `async` as `async_`: such items
    are accepted, and their parsed values are not stored back."""
    from openai.types.responses import ParsedResponseFunctionToolCall, ParsedResponseOutputMessage
    message = ParsedResponseOutputMessage.model_validate({
        "type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": '{"a": 1}', "annotations": [], "parsed": {"a": 1}}]})
    call = ParsedResponseFunctionToolCall.model_validate({
        "type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": '{"a": 1}',
        "status": "completed", "parsed_arguments": {"a": 1}})
    items = [{"role": "user", "content": "hi"}, message.model_dump(mode="json"), call.model_dump(mode="json"),
             {"type": "function_call_output", "call_id": "c1", "output": "x"}]
    assert "async_" in items[2] and "parsed_arguments" in items[2] and "parsed" in items[1]["content"][0]
    assert [m["role"] for m in _chat(items)] == ["user", "assistant", "tool"]
    stored = ResponsesRequest.model_validate({"input": items}).input_items()
    assert "parsed" not in stored[1]["content"][0] and not {"async_", "parsed_arguments"} & set(stored[2])


def test_input_items_sent_back_as_the_openai_client_lists_and_dumps_them():
    """`input_items.list` gives the client's item types, whose `model_dump()` carries their fields this
    server leaves out, as null (a text part's prompt_cache_breakpoint; created_by; an output's caller, name
    and namespace): a conversation rebuilt from them is accepted, and those fields are not stored back."""
    from openai.types.responses import (
        ResponseFunctionToolCallItem, ResponseFunctionToolCallOutputItem, ResponseInputMessageItem)
    message = ResponseInputMessageItem.model_validate({
        "type": "message", "id": "msg_1", "role": "user", "status": "completed",
        "content": [{"type": "input_text", "text": "weather?"}]})
    call = ResponseFunctionToolCallItem.model_validate({"type": "function_call", "id": "fc_1", "call_id": "c1",
                                                        "name": "f", "arguments": "{}", "status": "completed"})
    output = ResponseFunctionToolCallOutputItem.model_validate({
        "type": "function_call_output", "id": "fco_1", "call_id": "c1", "status": "completed",
        "output": [{"type": "input_text", "text": "sunny"}]})
    items = [item.model_dump(mode="json") for item in (message, call, output)]
    assert "prompt_cache_breakpoint" in items[0]["content"][0] and "created_by" in items[1]
    assert {"caller", "created_by", "name", "namespace"} <= set(items[2])
    messages = _chat(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"] and messages[2]["content"] == "sunny"
    stored = ResponsesRequest.model_validate({"input": items}).input_items()
    assert "prompt_cache_breakpoint" not in stored[0]["content"][0] and "created_by" not in stored[1]
    assert not {"caller", "created_by", "name", "namespace"} & set(stored[2])
    with pytest.raises(ValidationError, match="created_by"):
        _chat([{**items[1], "created_by": "someone"}])


def test_an_output_for_no_call_and_a_reasoning_only_input_are_400():
    with pytest.raises(APIError, match="No tool call found for function call output with call_id 'nobody'") as e:
        _chat([{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "nobody", "output": "x"}])
    assert e.value.status == 400 and e.value.param == "input"
    with pytest.raises(APIError, match="input holds no message") as e:
        _chat([{"type": "reasoning", "summary": []}])
    assert e.value.param == "input"


def test_an_item_of_the_previous_conversation_sent_again_is_400():
    """With previous_response_id, an input item whose id the conversation holds already (a client that sends
    back the previous output too), or one the input holds twice, would reach the prompt twice: a 400 naming
    it, as OpenAI's."""
    answer = {"type": "message", "id": "msg_out", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": []}]}
    history = ResponsesRequest.model_validate({"input": "hi"}).input_items() + [answer]
    again = ResponsesRequest.model_validate({"input": [answer, {"role": "user", "content": "more"}]})
    with pytest.raises(APIError, match="Duplicate item found with id 'msg_out'") as e:
        again.as_chat(False, history)
    assert e.value.status == 400 and e.value.param == "input"
    follow = ResponsesRequest.model_validate({"input": [{"role": "user", "content": "more", "id": "msg_new"}]})
    assert [m["role"] for m in follow.as_chat(False, history).chat_messages()] == ["user", "assistant", "user"]
    twice = ResponsesRequest.model_validate({"input": [answer, {"role": "user", "content": "more"}, answer]})
    with pytest.raises(APIError, match="Duplicate item found with id 'msg_out': the input holds it twice") as e:
        twice.as_chat(False)
    assert e.value.status == 400 and e.value.param == "input"


def test_item_references_read_the_stored_items():
    """An item_reference (type optional, as OpenAI's) becomes the stored item it names, an input or output item
    of a stored response: in the prompt and in the stored input, with its id, as if sent again; so an item the
    conversation of previous_response_id holds is a duplicate. An unknown id, or any with several API server
    processes (nothing stored), is a 400 naming it."""
    store = ResponseStore()
    first = ResponsesRequest.model_validate({"input": "weather?"})
    answer = {"type": "message", "id": "msg_out", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "Sunny.", "annotations": [], "logprobs": []}]}
    asked = first.input_items()
    store.put({"id": "resp_1", "output": [answer], "previous_response_id": None}, asked)
    serving = SimpleNamespace(responses=store)
    req = ResponsesRequest.model_validate({"input": [{"type": "item_reference", "id": asked[0]["id"]},
                                                     {"id": "msg_out"}, {"role": "user", "content": "and then?"}]})
    resolved = resolve_references(serving, req)
    messages = resolved.as_chat(False).chat_messages()
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "weather?"), ("assistant", "Sunny."), ("user", "and then?")]
    assert [item["id"] for item in resolved.input_items()[:2]] == [asked[0]["id"], "msg_out"]
    assert resolved.input_items()[1] == answer
    follow = resolve_references(serving, ResponsesRequest.model_validate({"input": [{"id": "msg_out"}],
                                                                          "previous_response_id": "resp_1"}))
    with pytest.raises(APIError, match="Duplicate item found with id 'msg_out'"):
        follow.as_chat(False, store.conversation("resp_1"))
    unknown = ResponsesRequest.model_validate({"input": [{"type": "item_reference", "id": "msg_gone"}]})
    with pytest.raises(APIError, match="Item with id 'msg_gone' not found") as e:
        resolve_references(serving, unknown)
    assert (e.value.status, e.value.param) == (400, "input")
    with pytest.raises(APIError, match="Item with id 'msg_out' not found: responses are not stored with "
                                       "--api-server-count above 1") as e:
        resolve_references(SimpleNamespace(responses=None),
                           ResponsesRequest.model_validate({"input": [{"id": "msg_out"}]}))
    assert (e.value.status, e.value.param) == (400, "input")


def test_errors_about_input_items_name_the_type_and_the_clients_field():
    """An item type this server does not read is named (not a message's missing fields); an item's field
    path is the client's, without the union branch it was validated as."""
    from fastapi.exceptions import RequestValidationError
    from tokenmill.server.errors import describe_validation_error

    def error(items):
        with pytest.raises(ValidationError) as e:
            ResponsesRequest.model_validate({"input": items})
        return describe_validation_error(RequestValidationError(e.value.errors()))
    message, param = error([{"type": "web_search_call", "id": "ws_1"}])
    assert "'web_search_call' is not supported" in message and param == "input"
    assert error([{"role": "user", "content": "hi", "name": "bob"}]) == (
        "Unknown or unsupported field(s): input.0.name", "input.0.name")
    assert "input.0.arguments: Field required" in error([{"type": "function_call", "call_id": "c", "name": "f"}])[0]


def test_errors_about_tools_name_the_tool_type():
    """A tool or tool_choice type other than a function (OpenAI's built-in tools, a custom or MCP tool, an
    allowed_tools choice) is named, not reported as a function's missing name or the tool's own fields."""
    from fastapi.exceptions import RequestValidationError
    from tokenmill.server.errors import describe_validation_error

    def error(**fields):
        with pytest.raises(ValidationError) as e:
            ResponsesRequest.model_validate({"input": "hi", **fields})
        return describe_validation_error(RequestValidationError(e.value.errors()))
    function = {"type": "function", "name": "f"}
    message, param = error(tools=[function, {"type": "custom", "name": "apply_patch", "format": {"type": "text"}}])
    assert message == "tool type 'custom' is not supported by tokenmill (only 'function')" and param == "tools"
    assert "'web_search_preview' is not supported" in error(tools=[{"type": "web_search_preview"}])[0]
    message, param = error(tools=[function], tool_choice={"type": "allowed_tools", "mode": "auto", "tools": [function]})
    assert "tool_choice type 'allowed_tools' is not supported" in message and param == "tool_choice"
    assert ResponsesRequest.model_validate({"input": "hi", "tools": [function],
                                            "tool_choice": {"type": "function", "name": "f"}}).tools


def test_errors_name_the_responses_fields():
    fmt = {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}
    req = ResponsesRequest.model_validate({"input": "hi", **fmt})
    assert [req.field_of(p) for p in ("max_tokens", "prompt", "response_format", "structured_outputs.json",
                                      "temperature")] == [
        "max_output_tokens", "input", "text.format", "text.format", "temperature"]
    assert ResponsesRequest.model_validate({"input": "hi"}).field_of("structured_outputs.json") == "tools"
    with pytest.raises(ValidationError, match="text.format of type 'json_schema' needs 'schema'"):
        ResponsesRequest.model_validate({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}})


def test_a_stream_cut_short_ends_with_a_numbered_error_event():
    """A stream the server cuts (a second SIGTERM) ends with OpenAI's error event, whose sequence_number
    follows the events before it, as every Responses event's does."""
    import asyncio

    import orjson

    from tokenmill.server.engine_streams import ServerStopping
    from tokenmill.server.serving import Serving

    class Engine:
        tokenizer, max_model_len, dead = None, 64, False

        async def generate(self, request_id, ids, params, priority, **kw):
            yield SimpleNamespace(finished=False)
            raise ServerStopping("the server is stopping")

    async def make_stream(merged):
        events = _EventStream(shape=None)
        async for _ in merged:
            yield events.event("response.output_text.delta", delta="x")
            yield events.event("response.output_text.delta", delta="y")

    async def main():
        serving = Serving(Engine(), ["tiny"], max_queue_len=8)
        serving.admit()
        params = SimpleNamespace(logprobs=None, prompt_logprobs=None, n=1, max_tokens=4)
        raw = SimpleNamespace(receive=lambda: asyncio.sleep(60))
        response = await serving.run(raw, [[1, 2]], params, 0, True, make_stream, None, event_names=True)
        return [chunk async for chunk in response.body_iterator]
    chunks = asyncio.run(main())
    events = [orjson.loads(c.split(b"data: ", 1)[1]) for c in chunks]
    assert [e["type"] for e in events] == ["response.output_text.delta"] * 2 + ["error"]
    assert events[-1]["code"] == "shutting_down"
    assert [e["sequence_number"] for e in events] == [0, 1, 2]


def test_truncation_auto_builds_the_sampling_parameters_once(tokenizer_dir, monkeypatch):
    """truncation "auto" renders several conversations of one request (a bisection over the items dropped), whose
    sampling parameters are the same: built once (a grammar's build grows with its tools), each conversation tried
    taking a copy of its own."""
    import asyncio

    from tokenmill.engine.tokenizer import Tokenizer
    from tokenmill.server.responses import prepare
    from tokenmill.server.serving import Serving

    serving = Serving(SimpleNamespace(tokenizer=Tokenizer(tokenizer_dir), max_model_len=256), ["tiny"], 16)
    built = []
    build = serving._params
    monkeypatch.setattr(serving, "_params", lambda *a, **kw: built.append(build(*a, **kw)) or built[-1])
    conversation = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: hello world " * 3}
                    for i in range(40)]
    req = ResponsesRequest.model_validate({"input": conversation, "max_output_tokens": 8, "truncation": "auto",
                                           "tools": [{"type": "function", "name": "f", "parameters": {}}],
                                           "tool_choice": "required"})
    chat, _, prompt, params = asyncio.run(prepare(serving, req, []))
    assert 1 < len(chat.messages) < len(conversation) and len(prompt) + 8 <= 256
    assert len(built) == 1 and params is not built[0] and params.structured_outputs is not None


def test_get_includes_what_the_stored_response_can_give():
    """GET's `include`: a reasoning item's `encrypted_content` is added to a body stored without it (the stored body
    unchanged); the output text's logprobs, never computed for a request without them, are a 400 naming the value,
    as is, with `stream`, a value the events were sent without; what the request included is there either way."""
    store = ResponseStore()
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
                 "content": [{"type": "reasoning_text", "text": "think"}]}
    message = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]}
    body = {"id": "r", "status": "completed", "output": [reasoning, message], "previous_response_id": None}
    store.put(body, [])
    got = retrieve(store, "r", ["reasoning.encrypted_content"], stream=False)
    assert unwrap_reasoning(got["output"][0]["encrypted_content"]) == "think" and got["output"][1] == message
    # without include the stored JSON is answered as kept, never decoded
    assert store.get("r") == body and retrieve(store, "r", [], stream=False) is None
    for include, stream, says in ((["message.output_text.logprobs"], False, "were never computed"),
                                  (["reasoning.encrypted_content"], True, "GET the response without 'stream'"),
                                  (["file_search_call.results"], False, "'file_search_call.results' is not supported")):
        with pytest.raises(APIError, match=says) as e:
            retrieve(store, "r", include, stream)
        assert (e.value.status, e.value.param) == (400, "include") and include[0] in e.value.message
    store.put(body, [], ResponsesRequest.model_validate({"input": "x", "top_logprobs": 0}).included())
    assert retrieve(store, "r", ["message.output_text.logprobs"], stream=False) == body
    assert retrieve(store, "r", ["message.output_text.logprobs"], stream=True) is None
