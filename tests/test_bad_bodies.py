"""Bodies built to be expensive to refuse, in process (the app on the test tokenizer and a stand-in engine that
records what reaches it): each 400 names the value and its limit, quotes a client's value cut short, stops at
a list's or map's first mistake, and comes before the engine where the API server can tell. What these bodies
cost is lab/validation_cost.py's to measure (docs/BENCHMARKS.md); these tests time nothing."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

VOCAB, CONTEXT = 512, 256
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
LONG = "x" * 100_000


@pytest.fixture(scope="module")
def api(tokenizer_dir):
    """(post, the request ids the stand-in engine was handed)."""
    from stand_in_engine import StandInEngine
    from tokenmill.engine.tokenizer import Tokenizer
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.server.app import build_app

    tok = Tokenizer(tokenizer_dir)
    handed: list[str] = []

    class Engine(StandInEngine):
        async def generate(self, request_id, ids, params, priority, **kw):
            handed.append(request_id)
            yield RequestOutput(request_id, None, ids, [CompletionOutput(0, "a", [40], None, None, "length")], True)

    app = build_app(Engine(tok, CONTEXT), vocab_size=VOCAB)

    def post(path: str, body) -> httpx.Response:
        async def send():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://tokenmill") as c:
                return await c.post(path, json=body)
        return asyncio.run(send())
    return post, handed


def test_a_clients_long_value_is_quoted_cut_short(api):
    """A value an error names was quoted whole: a 30 MB model name, unknown field's name, tool type, function
    name or previous_response_id came back in a 30 MB answer (an unknown field's twice, in the message and the
    param). Each is cut to its first 40 characters and its length; any message past 4,096 characters is cut."""
    from tokenmill.server.errors import error_body
    post, _ = api
    function = {"type": "function", "function": {"name": "f"}}
    cases = [("/v1/chat/completions", {**CHAT, "model": LONG}, 404, "model"),
             ("/v1/chat/completions", {**CHAT, LONG: 1}, 400, None),
             ("/v1/chat/completions", {**CHAT, "logit_bias": {LONG: "x"}}, 400, "logit_bias"),
             ("/v1/chat/completions", {**CHAT, "tools": [{"type": LONG}]}, 400, "tools"),
             ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
                 "name": "f", "parameters": {"type": LONG}}}]}, 400, "tools"),
             ("/v1/chat/completions", {**CHAT, "tools": [function], "tool_choice": {
                 "type": "function", "function": {"name": LONG}}}, 400, "tool_choice"),
             ("/v1/chat/completions", {**CHAT, "tool_choice": {"type": LONG}}, 400, "tool_choice"),
             ("/v1/chat/completions", {**CHAT, "stop": [LONG, ""]}, 400, "stop"),
             ("/v1/responses", {"input": "hi", "previous_response_id": LONG}, 400, "previous_response_id"),
             ("/v1/responses", {"input": [{"type": LONG}]}, 400, "input"),
             ("/invocations", {LONG: 1, "b": 2}, 400, None),
             ("/tokenize", {"prompt": "hi", "model": LONG}, 404, "model")]
    for path, body, status, param in cases:
        r = post(path, body)
        err = r.json()["error"]
        assert r.status_code == status and len(r.content) < 1000, (path, param, r.status_code, len(r.content))
        assert "x" * 17 in err["message"] and (param is None or err["param"] == param), (path, err)
    err = error_body(400, "y" * 10_000, "z" * 1000)["error"]
    assert err["message"].endswith("... (10,000 characters)") and len(err["message"]) < 4200, err["message"][-50:]
    assert err["param"].endswith("... (1,000 characters)") and len(err["param"]) < 300


def test_lists_and_maps_stop_at_their_first_mistake():
    """Pydantic made an error of each mistake (~6 us of the event loop each, made, turned into dicts and
    described), and the bounds before validation admit a vocabulary's worth of logit_bias and allowed_token_ids
    entries and a context's worth of messages, tools, document fields or token ids: 151,936 logit_bias values
    that are strings held the loop ~1 s. Each list stops at its first bad item, and logit_bias and a document
    at their first bad value, named."""
    from tokenmill.server.protocol import ChatCompletionRequest, DetokenizeRequest
    from tokenmill.server.protocol.responses import ResponsesRequest

    def errors(model, body) -> list[dict]:
        with pytest.raises(ValidationError) as e:
            model.model_validate(body)
        return e.value.errors()
    many = 1000
    for model, body, at in ((ChatCompletionRequest, {**CHAT, "allowed_token_ids": ["x"] * many}, "allowed_token_ids"),
                            (ChatCompletionRequest, {**CHAT, "stop_token_ids": ["x"] * many}, "stop_token_ids"),
                            (ChatCompletionRequest, {**CHAT, "bad_words": [None] * many}, "bad_words"),
                            (ChatCompletionRequest, {"messages": [{"role": "user", "content": 1}] * many}, "messages"),
                            (ChatCompletionRequest, {"messages": [{"role": "user", "content": [1] * many}]}, "messages"),
                            (ChatCompletionRequest, {**CHAT, "tools": [{"type": "function", "function": {}}] * many},
                             "tools"),
                            (ChatCompletionRequest, {**CHAT, "prediction": {"type": "content", "content": [None] * many}},
                             "prediction"),
                            (DetokenizeRequest, {"tokens": ["x"] * many}, "tokens"),
                            (ResponsesRequest, {"input": [{"role": "x", "content": "hi"}] * many}, "input")):
        found = errors(model, body)
        assert len(found) <= 3 and all(e["loc"][0] == at for e in found), (at, len(found), found[:4])
    for body, says in (({**CHAT, "logit_bias": {str(i): "x" for i in range(many)}},
                        "the value for '0' is string 'x'"),
                       ({**CHAT, "documents": [{f"k{i}": 1 for i in range(many)}]},
                        "document 0's field 'k0' is number 1")):
        found = errors(ChatCompletionRequest, body)
        assert len(found) == 1 and says in str(found[0]["ctx"]["error"]), found[:2]


def test_token_ids_past_the_vocabulary_are_refused_before_the_engine(api):
    """The ids logit_bias, allowed_token_ids and stop_token_ids name were checked against the vocabulary only
    by the engine: a request was admitted, queued and handed over (a vocabulary's worth of logit_bias with it)
    before its 400. The API server knows the vocabulary's size and refuses it first, naming the id."""
    post, handed = api
    for field, value in (("logit_bias", {"5": 1, "600": 1}), ("allowed_token_ids", [5, 600]),
                         ("stop_token_ids", [600])):
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi", "max_tokens": 1})):
            before = len(handed)
            err = post(path, {**body, field: value}).json()["error"]
            assert err["param"] == field and err["message"] == f"Token id 600 is out of range for a vocabulary of " \
                f"{VOCAB}.", (path, err)
            assert len(handed) == before, (path, field)
    assert post("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 1}}).status_code == 200


def test_a_thinking_budget_needs_a_reasoning_parser_and_an_integer_of_at_least_zero(api, tokenizer_dir):
    """vLLM's thinking_token_budget counts the block that a reasoning parser's tags mark: on a server without
    one it is a 400 naming the field and the flag; with one, a budget that is not an integer >= 0 is a 400
    naming the value, and a budget reaches the engine with the parser's tags (a chat's, with whether its
    prompt leaves the block open). Each 400 before the engine."""
    from stand_in_engine import StandInEngine
    from tokenmill.engine.tokenizer import Tokenizer
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.server.app import build_app
    from tokenmill.server.serving import ChatOptions

    post, handed = api
    completion = {"prompt": "hi", "max_tokens": 1}
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", completion)):
        before = len(handed)
        err = post(path, {**body, "thinking_token_budget": 8}).json()["error"]
        assert err["param"] == "thinking_token_budget" and "--reasoning-parser" in err["message"], (path, err)
        assert len(handed) == before
    tok = Tokenizer(tokenizer_dir)
    seen = []

    class Engine(StandInEngine):
        async def generate(self, request_id, ids, params, priority, **kw):
            seen.append(params)
            yield RequestOutput(request_id, None, ids, [CompletionOutput(0, "a", [40], None, None, "length")], True)

    app = build_app(Engine(tok, CONTEXT), vocab_size=VOCAB, chat=ChatOptions(reasoning_parser="qwen3"))

    def post_parsed(path: str, body) -> httpx.Response:
        async def send():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://tokenmill") as c:
                return await c.post(path, json=body)
        return asyncio.run(send())
    for value, says in ((-1, "an integer >= 0 (or None: no budget), got -1"), (2.5, "(got number 2.5)"),
                        ("8", "(got string '8')"), (True, "(got boolean true)")):
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", completion)):
            r = post_parsed(path, {**body, "thinking_token_budget": value})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "thinking_token_budget" and says in err["message"], err
    assert not seen
    tags = tuple(tok.encode(t, add_special_tokens=False)[0] for t in ("<think>", "</think>"))
    for path, body, in_think in (("/v1/chat/completions", CHAT, False), ("/v1/completions", completion, None)):
        assert post_parsed(path, {**body, "thinking_token_budget": 0}).status_code == 200
        assert (seen[-1].thinking_token_budget, seen[-1].think_tags, seen[-1].in_think) == (0, tags, in_think)


@settings(max_examples=80, deadline=None)
@given(value=st.recursive(st.none() | st.integers() | st.text(alphabet='[]{}"\\ab\u00e9'),
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                              st.text(alphabet='[]{}"\\a'), inner, max_size=4), max_leaves=30),
       ascii_only=st.booleans())
def test_a_bodys_nesting_and_containers_are_read_from_its_text(value, ascii_only):
    """The depth and the arrays and objects of a body, from its bytes as parsed JSON has them: brackets and
    escaped quotes and backslashes in strings are none of them."""
    from tokenmill.sampling_params import json_depth
    from tokenmill.server.body import text_shape

    def containers(v) -> int:
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        return isinstance(v, (dict, list)) + sum(map(containers, items))
    assert text_shape(json.dumps(value, ensure_ascii=ascii_only).encode()) == (json_depth(value), containers(value))


def test_bodies_of_many_arrays_are_refused_before_they_are_walked(api, monkeypatch):
    """A body's arrays and objects were walked one by one (its depth, ~0.25 us each) and scanned by the garbage
    collector while it was parsed and held (~0.1-0.9 us each, a pass): 10M empty arrays (30 MB) held the event
    loop 6.3 s before their 400, 230,000 arrays nested 63 deep 14 s. The body is parsed with the collector
    paused, its depth and containers read from its text, and one of more than MAX_BODY_CONTAINERS is refused
    before the collector runs again; the values nested in chat_template_kwargs (walked one by one on the
    tokenizer thread) and a prediction's content parts are bounded by the context, as the messages are."""
    import gc

    import orjson

    from tokenmill.server.body import MAX_BODY_CONTAINERS
    post, _ = api
    parse, collecting = orjson.loads, []
    monkeypatch.setattr(orjson, "loads", lambda raw: collecting.append(gc.isenabled()) or parse(raw))
    r = post("/v1/chat/completions", {**CHAT, "x": [[]] * MAX_BODY_CONTAINERS})
    assert r.json()["error"]["message"] == f"The request body holds {MAX_BODY_CONTAINERS + 4:,} arrays and objects; " \
        f"at most {MAX_BODY_CONTAINERS:,} are accepted." and collecting == [False] and gc.isenabled()
    for field, value, says in (("chat_template_kwargs", {"k": [[1]] * (CONTEXT // 2)}, "more than 256 values"),
                               ("prediction", {"type": "content", "content": [None] * (CONTEXT + 1)},
                                "'prediction' holds 257 content parts")):
        err = post("/v1/chat/completions", {**CHAT, "max_tokens": "x", field: value}).json()["error"]
        assert err["param"] == field and says in err["message"], err
    assert post("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"k": [[1]] * 100}}).status_code == 200


def test_a_grammar_spec_past_its_length_is_refused_before_it_is_walked_or_built(monkeypatch):
    """A JSON schema over the grammar's 1,000,000 characters was walked and checked (a 990,000-property one, 31
    MB, ~2 s), and the schema of tools a tool_choice forces was built of every tool's parameters (35,678 tools
    of 24 properties, 26 MB, 4.8 s), before the engine refused them for their length. Both are refused first."""
    from tokenmill import structured_outputs_params
    from tokenmill.sampling_params import SamplingParamError, StructuredOutputsParams
    from tokenmill.server import tool_choice
    from tokenmill.server.protocol import ChatCompletionRequest

    def never(*args, **kwargs):
        raise AssertionError("walked or built")
    monkeypatch.setattr(structured_outputs_params, "check_schema", never)
    monkeypatch.setattr(tool_choice, "required_tools_schema", never)
    with pytest.raises(SamplingParamError, match=r"the JSON schema is at least 1,0\d\d,\d\d\d characters long, over "
                                                 r"the limit of 1,000,000"):
        StructuredOutputsParams(json={"enum": ["x" * 100] * 10_000})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"enum": ["x" * 100] * 1_000}}}
    with pytest.raises(ValidationError, match=r"the tools' parameters are at least 1,0\d\d,\d\d\d characters"):
        ChatCompletionRequest.model_validate({**CHAT, "tools": [tool] * 10, "tool_choice": "required"})
