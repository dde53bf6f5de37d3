"""Responses' streaming events (server/responses.py `_EventStream`): every output token's logprob reaches
the message's text, as in the response that is not streamed, those of tokens after the last text delta
included."""
from __future__ import annotations

from tokenmill.server.responses import _EventStream


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
