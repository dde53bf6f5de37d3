"""Tools, reasoning and structured output through a live `tokenmill serve --enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3 --chat-template FILE`, driven by the official `openai`
client and LangChain. A tiny random model picks no tool by itself: calls come from decoding under the
tools' schema (tool_choice "required" or named), or from output steered by a grammar into the hermes
format, which the parser then reads."""
from __future__ import annotations

import json
import re
import shutil

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from test_server import ServerProcess

# ChatML with Qwen3's way of showing tools: their JSON in the system turn, calls as <tool_call> blocks
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    # an assistant turn's thinking, where the client sent it back (Qwen3's template keeps it within a turn)
    "{% if m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    # as gpt-oss's template does with it; and then opens a thinking block, as thinking models' templates do
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n<think>\n{% endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCRIPTED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


@pytest.fixture(scope="module")
def agent_server(qwen3_long_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent")
    template = tmp / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    # its tokenizer marks the call tags special, as some Hermes checkpoints' do: skipping special tokens in
    # the output would hide every call from the parser (tools in use keep them)
    model = tmp / "model"
    shutil.copytree(qwen3_long_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    assert len(tok) <= 512          # new ids within the model's embedding rows
    tok.save_pretrained(model)
    s = ServerProcess(str(model), tmp, "--max-model-len", "2048", "--num-kv-blocks", "2048", "--block-size", "8",
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                      "--chat-template", str(template))
    yield s
    assert s.stop() == 0, s.log_path.read_text()[-3000:]


def _no_think(server) -> dict:
    """A logit bias that keeps a reply from opening a thinking block: with the reasoning parser, a grammar
    holds the answer after the block, and a first token may open one besides what the grammar allows."""
    tag = httpx.post(server.url + "/tokenize", timeout=30, json={"prompt": "<think>", "add_special_tokens": False})
    return {str(tag.json()["tokens"][0]): -100}


def _check_weather(call):
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Tokyo") and args["unit"] in ("c", "f")


def test_tools_are_rendered_through_the_template(agent_server):
    r = httpx.post(agent_server.url + "/tokenize", timeout=30, json={"messages": USER, "tools": [WEATHER]})
    text = httpx.post(agent_server.url + "/detokenize", timeout=30, json={"tokens": r.json()["tokens"]}).json()
    assert "# Tools" in text["prompt"] and '"get_weather"' in text["prompt"]
    # vLLM's fields that chat completions take at a no-op value, as /tokenize's messages form takes them
    same = httpx.post(agent_server.url + "/tokenize", timeout=30, json={
        "messages": USER, "tools": [WEATHER], "chat_template": None, "mm_processor_kwargs": {}})
    assert same.status_code == 200 and same.json()["tokens"] == r.json()["tokens"], same.text
    other = httpx.post(agent_server.url + "/tokenize", timeout=30, json={"messages": USER, "chat_template": "{{ 1 }}"})
    assert other.status_code == 400 and other.json()["error"]["param"] == "chat_template", other.text


def test_tool_choice_required_and_named(agent_server):
    client = agent_server.client()
    r = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    for call in c.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        assert (call.function.name == "get_weather") == ("city" in args)
    r = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME], max_tokens=120, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "stop" and len(c.message.tool_calls) == 1
    _check_weather(c.message.tool_calls[0])
    chunks = list(client.chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER], tool_choice={"type": "function", "function": {
            "name": "get_weather"}}, max_tokens=120, temperature=0, stream=True))
    calls = [tc for ch in chunks for choice in ch.choices for tc in (choice.delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    args = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(args) == json.loads(c.message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("choice", ["named", "required"])
def test_constrained_calls_stream_their_arguments_and_keep_them_when_cut_short(agent_server, choice):
    """Under a named function or "required", each call's arguments come as they are generated, its first
    delta carrying the call's id and name; cut by max_tokens, the last call keeps its partial arguments
    (finish_reason "length"), as OpenAI and vLLM return it, streamed and not alike."""
    client = agent_server.client()
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    cut = None
    for max_tokens, finish in ((120, "tool_calls" if choice == "required" else "stop"), (None, "length")):
        kw = dict(model="tiny", messages=USER, tools=[WEATHER], tool_choice=tool_choice, temperature=0,
                  max_tokens=max_tokens or cut, parallel_tool_calls=False)
        r = client.chat.completions.create(**kw)
        cut = r.usage.completion_tokens - 5           # then the same answer, cut inside its arguments
        c = r.choices[0]
        assert c.finish_reason == finish and c.message.content is None and c.message.tool_calls, c
        whole = c.message.tool_calls[-1]
        assert whole.function.name == "get_weather" and whole.id.startswith("call_")
        chunks = list(client.chat.completions.create(**kw, stream=True))
        deltas = [tc for ch in chunks for choice_ in ch.choices for tc in (choice_.delta.tool_calls or [])]
        heads = [d for d in deltas if d.id is not None]
        assert [(d.index, d.function.name) for d in heads] == [(i, t.function.name)
                                                             for i, t in enumerate(c.message.tool_calls)]
        assert all(d.id.startswith("call_") for d in heads)
        assert all(d.function.name is None for d in deltas if d.id is None)
        last = [d for d in deltas if d.index == len(heads) - 1]
        assert len([d for d in last if d.function.arguments]) > 1          # not held back to the end
        assert "".join(d.function.arguments or "" for d in last) == whole.function.arguments
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [finish]
        if finish != "length":
            _check_weather(whole)
        else:
            assert whole.function.arguments.startswith("{")
            with pytest.raises(json.JSONDecodeError):
                json.loads(whole.function.arguments)


def test_auto_tool_choice_parses_hermes_calls_whole_and_streamed(agent_server):
    client = agent_server.client()
    steer = {"structured_outputs": {"regex": re.escape(SCRIPTED)}}
    r = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], max_tokens=200,
                                       logit_bias=_no_think(agent_server), extra_body=steer)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [json.loads(t.function.arguments) for t in c.message.tool_calls] == [{"city": "Paris", "unit": "c"}]
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], max_tokens=200,
                                                 logit_bias=_no_think(agent_server), extra_body=steer, stream=True))
    deltas = [tc for ch in chunks for choice in ch.choices for tc in (choice.delta.tool_calls or [])]
    content = "".join(choice.delta.content or "" for ch in chunks for choice in ch.choices)
    assert "<tool_call>" not in content and content.strip() == ""
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris", "unit": "c"}
    assert [choice.finish_reason for ch in chunks for choice in ch.choices if choice.finish_reason] == ["tool_calls"]
    # the call goes back as history, with the tool's answer
    history = USER + [r.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": "18 C"}]
    again = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=4)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens


def test_auto_tool_choice_keeps_one_call_without_parallel_calls(agent_server):
    """Two hermes calls in the output: both by default, the first alone with `parallel_tool_calls: false`
    (OpenAI's and vLLM's behaviour), streamed and not."""
    client = agent_server.client()
    two = SCRIPTED + "\n" + SCRIPTED.replace("get_weather", "get_time").replace(
        '{"city": "Paris", "unit": "c"}', '{"zone": "UTC"}')
    kw = dict(model="tiny", messages=USER, tools=[WEATHER, TIME], max_tokens=200, logit_bias=_no_think(agent_server),
              extra_body={"structured_outputs": {"regex": re.escape(two)}})
    for parallel, names in ((None, ["get_weather", "get_time"]), (False, ["get_weather"])):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = client.chat.completions.create(**kw, **extra)
        assert [t.function.name for t in r.choices[0].message.tool_calls] == names
        chunks = list(client.chat.completions.create(**kw, **extra, stream=True))
        heads = [tc for ch in chunks for choice in ch.choices for tc in (choice.delta.tool_calls or []) if tc.id]
        assert [(tc.index, tc.function.name) for tc in heads] == list(enumerate(names))


def test_tool_choice_none_still_shows_the_tools(agent_server):
    """tool_choice "none": the template shows the tools as "auto" does (vLLM's default, and what OpenAI's models
    know), so an agent's turns share the prompt's cached prefix; the output is not read for calls."""
    shown = httpx.post(agent_server.url + "/tokenize", timeout=30, json={"messages": USER, "tools": [WEATHER]})
    r = agent_server.client().chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice="none",
                                                      max_tokens=1)
    assert r.usage.prompt_tokens == len(shown.json()["tokens"]) and not r.choices[0].message.tool_calls


def test_bad_tool_choices_are_400(agent_server):
    r = httpx.post(agent_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": USER, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice" and "nope" in r.text
    r = httpx.post(agent_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": USER, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    # the Responses API the same, its message the check's own
    for choice in ("required", {"type": "function", "name": "nope"}):
        r = httpx.post(agent_server.url + "/v1/responses", timeout=30, json={
            "input": "hi", "tools": [] if choice == "required" else [
                {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}],
            "tool_choice": choice})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "tool_choice" and "pydantic" not in error["message"], error


def test_reasoning_goes_to_reasoning_and_reasoning_content(agent_server):
    """The thinking under vLLM's current name (`reasoning`) and the one DeepSeek's API and older vLLM use
    (`reasoning_content`): clients read one or the other."""
    client = agent_server.client()
    script = "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny."
    steer = {"structured_outputs": {"regex": re.escape(script)}}
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200, extra_body=steer)
    msg = r.choices[0].message
    assert msg.content == "It is sunny."
    assert msg.model_extra["reasoning"] == msg.model_extra["reasoning_content"] == "The user asks about Paris."
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=200, extra_body=steer,
                                                 stream=True))
    for name in ("reasoning", "reasoning_content"):
        reasoning = "".join((choice.delta.model_extra or {}).get(name) or "" for ch in chunks for choice in ch.choices)
        assert reasoning == "The user asks about Paris.", name
    content = "".join(choice.delta.content or "" for ch in chunks for choice in ch.choices)
    assert content == "It is sunny."
    # vLLM's include_reasoning false: the thinking is left out of the answer, still not in its content
    hidden = {**steer, "include_reasoning": False}
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200, extra_body=hidden)
    msg = r.choices[0].message
    assert msg.content == "It is sunny."
    assert msg.model_extra["reasoning"] is msg.model_extra["reasoning_content"] is None
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=200, extra_body=hidden,
                                                 stream=True))
    assert not any((choice.delta.model_extra or {}).get(name) for ch in chunks for choice in ch.choices
                   for name in ("reasoning", "reasoning_content"))
    assert "".join(choice.delta.content or "" for ch in chunks for choice in ch.choices) == "It is sunny."


def test_a_user_quoting_the_think_tag_opens_no_block(agent_server):
    """The reasoning parser reads whether the reply starts inside a thinking block from the prompt's last
    turn: a `<think>` quoted in the user's message leaves the answer in content."""
    client = agent_server.client()
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What does <think> do?"}],
                                       max_tokens=60, temperature=0, logit_bias=_no_think(agent_server),
                                       extra_body={"structured_outputs": {"regex": re.escape("It opens a block.")}})
    msg = r.choices[0].message
    assert msg.content == "It opens a block." and msg.model_extra.get("reasoning_content") is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_reasoning_tokens_are_counted_in_usage(agent_server):
    """usage's reasoning tokens: the output tokens between the <think> and </think> tokens, here read off
    the tokens that logprobs names; the same count streamed and from /v1/responses. (A random model spells
    the tags out in pieces as readily as it writes their tokens: a logit bias makes it write the tokens, as
    a trained model does.)"""
    client = agent_server.client()
    script = "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny."
    tags = [httpx.post(agent_server.url + "/tokenize", timeout=30, json={"prompt": t, "add_special_tokens": False}
                       ).json()["tokens"] for t in ("<think>", "</think>")]
    assert all(len(t) == 1 for t in tags), tags
    bias = {str(t[0]): 50 for t in tags}
    args = dict(model="tiny", messages=USER, max_tokens=200, temperature=0, logit_bias=bias,
                extra_body={"structured_outputs": {"regex": re.escape(script)}})
    r = client.chat.completions.create(logprobs=True, **args)
    tokens = [t.token for t in r.choices[0].logprobs.content]
    expected = tokens.index("</think>") - tokens.index("<think>") - 1
    assert expected > 3 and r.usage.completion_tokens == len(tokens)
    assert r.usage.completion_tokens_details.reasoning_tokens == expected
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == expected
    # a block the template opened (with a reasoning effort): the tokens before </think>, or all of them;
    # Responses count as chat does
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0, logprobs=True,
                                       reasoning_effort="high")
    tokens = [t.token for t in r.choices[0].logprobs.content]
    thinking = tokens.index("</think>") if "</think>" in tokens else len(tokens)
    assert thinking > 0 and r.usage.completion_tokens_details.reasoning_tokens == thinking
    resp = client.responses.create(model="tiny", input=USER, max_output_tokens=12, temperature=0,
                                   reasoning={"effort": "high"})
    assert resp.usage.output_tokens == len(tokens) and resp.usage.output_tokens_details.reasoning_tokens == thinking
    # thinking cut off by max_tokens: every token is reasoning but the opening tag
    r = client.chat.completions.create(**{**args, "max_tokens": 5})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens_details.reasoning_tokens == 4
    # no block: none
    r = client.chat.completions.create(**{**args, "logit_bias": _no_think(agent_server),
                                          "extra_body": {"structured_outputs": {"regex": "It is sunny."}}})
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def _stream_ids_and_text(server, path: str, body: dict) -> tuple[list[int], dict[str, str]]:
    """A streamed answer's token ids (`return_token_ids`) and its text by field (reasoning, content, text)."""
    ids, text = [], {}
    with httpx.stream("POST", server.url + path, timeout=60, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: "):])["choices"]:
                    ids += choice.get("token_ids") or []
                    for name, value in {**choice.get("delta", {}), "text": choice.get("text")}.items():
                        if name in ("reasoning", "content", "text") and value:
                            text[name] = text.get(name, "") + value
    return ids, text


def test_a_thinking_token_budget_closes_the_block_at_the_budget(agent_server):
    """vLLM's thinking_token_budget: the template opens the block (a reasoning effort) and a bias keeps the
    model from closing it; </think> comes as the token after the budget's, the reasoning holds exactly the
    budget's tokens and the answer follows within max_tokens, streamed as answered whole. Under a JSON schema
    the grammar holds the answer after the forced </think>. On completions, a prompt that ends inside a block
    (its last think tag is <think>) opens it."""
    close = httpx.post(agent_server.url + "/tokenize", timeout=30, json={"prompt": "</think>", "add_special_tokens":
                                                                         False}).json()["tokens"][0]
    chat = {"model": "tiny", "messages": USER, "max_tokens": 12, "temperature": 0, "reasoning_effort": "high",
            "logit_bias": {str(close): -100}, "return_token_ids": True}
    for budget in (0, 4):
        r = httpx.post(agent_server.url + "/v1/chat/completions", timeout=60,
                       json={**chat, "thinking_token_budget": budget}).json()
        choice, ids = r["choices"][0], r["choices"][0]["token_ids"]
        assert ids[budget] == close and close not in ids[:budget] and len(ids) == 12, (budget, ids)
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == budget
        assert choice["message"]["content"], choice
        streamed = _stream_ids_and_text(agent_server, "/v1/chat/completions", {**chat, "thinking_token_budget": budget})
        whole = {k: choice["message"][k] for k in ("reasoning", "content") if choice["message"][k]}
        assert streamed == (ids, whole)
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}}, "required": ["city"]}
    r = httpx.post(agent_server.url + "/v1/chat/completions", timeout=60, json={
        **chat, "max_tokens": 40, "thinking_token_budget": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}}).json()
    choice = r["choices"][0]
    assert choice["token_ids"][3] == close and choice["finish_reason"] == "stop", choice
    assert json.loads(choice["message"]["content"])["city"] in ("Paris", "Tokyo")
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
    completion = {"model": "tiny", "prompt": "The weather in Paris<think>", "max_tokens": 6, "temperature": 0,
                  "logit_bias": {str(close): -100}, "thinking_token_budget": 2, "return_token_ids": True}
    r = httpx.post(agent_server.url + "/v1/completions", timeout=60, json=completion).json()
    ids = r["choices"][0]["token_ids"]
    assert ids[2] == close and close not in ids[:2] and len(ids) == 6, ids
    assert _stream_ids_and_text(agent_server, "/v1/completions", completion) == (ids, {"text": r["choices"][0]["text"]})
    # the forced </think> outside allowed_token_ids is the budget's, not a sampled token that no list allowed
    allowed = httpx.post(agent_server.url + "/tokenize", timeout=30, json={"prompt": " sunny and warm",
                                                                          "add_special_tokens": False}).json()["tokens"]
    r = httpx.post(agent_server.url + "/v1/completions", timeout=60, json={**completion, "allowed_token_ids": allowed})
    ids = r.json()["choices"][0]["token_ids"]
    assert r.status_code == 200 and ids[2] == close and set(ids) - {close} <= set(allowed), r.text


class City(BaseModel):
    name: str = Field(max_length=8)
    population: int = Field(ge=0, le=1000)
    capital: bool


def test_parse_with_a_pydantic_model_and_json_modes(agent_server):
    client = agent_server.client()
    r = client.chat.completions.parse(model="tiny", messages=USER, response_format=City, max_tokens=120,
                                      temperature=0)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and 0 <= city.population <= 1000
    r = client.chat.completions.create(model="tiny", messages=USER, response_format={"type": "json_object"},
                                       max_tokens=150, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    bad = httpx.post(agent_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": USER, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}})
    assert bad.status_code == 400, bad.text
    assert "frobnicate" in bad.json()["error"]["message"] or "type" in bad.json()["error"]["message"]
    # a schema the engine refuses is named by the field the client sent it in
    assert bad.json()["error"]["param"] == "response_format"
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "frobnicate"}}}}}
    bad = httpx.post(agent_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": USER, "tools": [bad_tool], "tool_choice": "required"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools", bad.text
    bad = httpx.post(agent_server.url + "/v1/responses", timeout=30, json={"input": "x", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "array", "uniqueItems": True}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format", bad.text


def test_a_forced_tool_call_takes_a_response_format_beside_it(agent_server):
    """The Agents SDK sends an agent's output_type (response_format, Responses' text.format) in every turn, a
    forced tool_choice beside it: the call is decoded under the tools' schema, as OpenAI and vLLM do."""
    fmt = {"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema(), "strict": True}}
    r = httpx.post(agent_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": USER, "tools": [WEATHER], "tool_choice": "required", "response_format": fmt,
        "parallel_tool_calls": False, "max_tokens": 120, "temperature": 0})
    assert r.status_code == 200, r.text
    _check_weather(openai.types.chat.ChatCompletion.model_validate(r.json()).choices[0].message.tool_calls[0])
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = httpx.post(agent_server.url + "/v1/responses", timeout=30, json={
        "input": "weather in Paris?", "tools": [tool], "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "City", "schema": City.model_json_schema()}},
        "max_output_tokens": 120, "temperature": 0})
    assert r.status_code == 200 and r.json()["output"][0]["type"] == "function_call", r.text


def test_auto_tools_beside_a_response_format_call_a_tool_or_answer_in_it(agent_server):
    """The Agents SDK sends an agent's output_type (response_format, Responses' text.format) beside its tools,
    tool_choice "auto", in every turn: decoded under a grammar of either hermes calls or the format's JSON, the
    model may call a tool (steered here by a logit bias on the <tool_call> tag) or answer in the format (the tag
    banned), as against OpenAI, whole and streamed."""
    client = agent_server.client()
    tag = httpx.post(agent_server.url + "/tokenize", timeout=30, json={
        "prompt": "<tool_call>", "add_special_tokens": False}).json()["tokens"]
    assert len(tag) == 1
    fmt = {"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema(), "strict": True}}
    kw = dict(model="tiny", messages=USER, tools=[WEATHER], response_format=fmt, parallel_tool_calls=False,
              max_tokens=120, temperature=0)
    call = {**_no_think(agent_server), str(tag[0]): 100}
    c = client.chat.completions.create(**kw, logit_bias=call).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1, c
    _check_weather(c.message.tool_calls[0])
    chunks = list(client.chat.completions.create(**kw, logit_bias=call, stream=True))
    deltas = [tc for ch in chunks for choice in ch.choices for tc in (choice.delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.id] == ["get_weather"]
    assert "".join(d.function.arguments or "" for d in deltas) == c.message.tool_calls[0].function.arguments
    c = client.chat.completions.create(**kw, logit_bias={**call, str(tag[0]): -100}).choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls, c
    City.model_validate_json(c.message.content)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = client.responses.create(model="tiny", input="weather in Paris?", tools=[tool], max_output_tokens=120,
                                temperature=0, text={"format": {"type": "json_schema", "name": "City",
                                                                "schema": City.model_json_schema()}})
    assert r.status == "completed" and r.output[-1].type in ("function_call", "message"), r
    # a schema that does not compile is named by the field it came in
    frobnicate = {"type": "object", "properties": {"a": {"type": "frobnicate"}}}
    bad = httpx.post(agent_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": frobnicate}}],
        "response_format": fmt})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools", bad.text
    bad = httpx.post(agent_server.url + "/v1/responses", timeout=30, json={"input": "x", "tools": [tool], "text": {
        "format": {"type": "json_schema", "name": "x", "schema": frobnicate}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format", bad.text


def test_logit_bias_on_both_endpoints(agent_server):
    client = agent_server.client()
    forced = 65
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    ids = httpx.post(agent_server.url + "/tokenize", timeout=30, json={"prompt": r.choices[0].text,
                                                                       "add_special_tokens": False}).json()
    assert ids["tokens"] == [forced] * 3
    c = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, logit_bias={str(forced): 100},
                                       extra_body={"ignore_eos": True})
    assert c.choices[0].message.content == r.choices[0].text[:len(c.choices[0].message.content)]
    # vLLM's allowed_token_ids: the one id allowed is the whole output, sampled or not
    a = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, temperature=1.0,
                                       extra_body={"ignore_eos": True, "allowed_token_ids": [forced]})
    assert a.choices[0].message.content == r.choices[0].text[:len(a.choices[0].message.content)]
    for field, value, word in (("logit_bias", {"100000": 5}, "vocabulary"), ("logit_bias", {"5": 101}, "100"),
                               ("allowed_token_ids", [5, 100000], "vocabulary"),
                               ("allowed_token_ids", [], "at least 1")):
        bad = httpx.post(agent_server.url + "/v1/completions", timeout=30, json={
            "prompt": "x", "max_tokens": 1, field: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text
        assert word in bad.json()["error"]["message"]


def test_min_tokens_on_both_endpoints(agent_server):
    client = agent_server.client()
    # the model's end-of-sequence id forced by logit_bias ends each output at its first token; min_tokens
    # (vLLM's extra parameter) holds it back for that many tokens, so that it ends the output after them
    eos = httpx.post(agent_server.url + "/tokenize", timeout=30, json={
        "prompt": "<|im_end|>", "add_special_tokens": False}).json()["tokens"]
    assert len(eos) == 1
    for extra, tokens in (({}, 1), ({"min_tokens": 5}, 6)):
        r = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0,
                                      logit_bias={str(eos[0]): 100}, extra_body=extra)
        assert r.usage.completion_tokens == tokens and r.choices[0].finish_reason == "stop", (extra, r)
        c = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0,
                                           logit_bias={str(eos[0]): 100}, extra_body=extra)
        assert c.usage.completion_tokens == tokens and c.choices[0].finish_reason == "stop", (extra, c)
    bad = httpx.post(agent_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": USER, "max_tokens": 4, "min_tokens": 6})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens", bad.text
    assert "min_tokens must be <= max_tokens (4), got 6" in bad.json()["error"]["message"]


def test_responses_with_tools(agent_server):
    client = agent_server.client()
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = client.responses.create(model="tiny", input="weather in Paris?", tools=[tool], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Tokyo")
    events = list(client.responses.create(model="tiny", input="weather in Paris?", tools=[tool],
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_output_tokens=200, temperature=0, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == calls[0].arguments
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == done[0].arguments      # streamed as generated


def test_responses_order_text_around_a_tool_call_alike_whole_and_streamed():
    """Text before and after a hermes call: the response's output items are the streamed ones (a message,
    the call, a message), not one message of both texts ahead of the call."""
    from types import SimpleNamespace
    from tokenmill.server.chat import ChoiceText
    from tokenmill.server.protocol.responses import ResponsesRequest
    from tokenmill.server.response_output import _EventStream, output_items
    from tokenmill.server.tool_parsers import HermesToolParser
    serving = SimpleNamespace(reasoning_parser=None, tool_parser=HermesToolParser, think_tags=None)
    req = ResponsesRequest.model_validate({"input": "weather?", "tools": [
        {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]})
    chat = req.as_chat(False)
    shape = SimpleNamespace(req=req)
    text = "Checking. " + SCRIPTED + " Done."
    whole = output_items(shape, ChoiceText(serving, chat, ""), text, [])
    events, streamed = _EventStream(shape), ChoiceText(serving, chat, "")
    for part in [p for i in range(0, len(text), 5) for p in streamed.feed(text[i:i + 5])] + streamed.finish():
        events.delta(part)
    events.close_all()
    summary = lambda items: [(i["type"], i["content"][0]["text"] if i["type"] == "message" else i["arguments"])
                             for i in items]
    assert summary(whole) == summary(events.items) == [
        ("message", "Checking. "), ("function_call", '{"city": "Paris", "unit": "c"}'), ("message", " Done.")]


def test_responses_carry_reasoning_between_turns(agent_server):
    """A reasoning item sent back reaches the template as the next assistant message's reasoning_content;
    with include ["reasoning.encrypted_content"] (what Codex sends with store: false) reasoning items carry
    an opaque encrypted_content that stands for their text when sent back alone."""
    client = agent_server.client()
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "c"}'}
    answer = {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}
    thought = "The user asks about the weather in Paris, so I call the tool."

    def input_tokens(*items) -> int:
        return client.responses.create(model="tiny", input=[USER[0], *items, call, answer], tools=[tool],
                                       max_output_tokens=1, temperature=0, store=False).usage.input_tokens
    plain = input_tokens()
    said = input_tokens({"type": "reasoning", "id": "rs_1", "summary": [],
                         "content": [{"type": "reasoning_text", "text": thought}]})
    assert said > plain + 10
    assert input_tokens({"type": "reasoning", "id": "rs_1",
                         "summary": [{"type": "summary_text", "text": thought}]}) == said
    # a thinking response (the template opens the block under a reasoning effort), its items sent back
    r = client.responses.create(model="tiny", input=USER, max_output_tokens=12, temperature=0, store=False,
                                reasoning={"effort": "high"}, include=["reasoning.encrypted_content"])
    item = next(i for i in r.output if i.type == "reasoning")
    assert isinstance(item.encrypted_content, str) and item.content[0].text
    blob_only = {"type": "reasoning", "id": item.id, "summary": [], "encrypted_content": item.encrypted_content}
    again = input_tokens(item.model_dump(exclude_none=True))
    assert again > plain and input_tokens(blob_only) == again
    # another server's blob is not read, nor content of a shape no client sends
    assert input_tokens({**blob_only, "encrypted_content": "gAAAAABfoo"}) == plain
    assert input_tokens({"type": "reasoning", "content": True, "summary": [{"text": 3}]}) == plain
    events = list(client.responses.create(model="tiny", input=USER, max_output_tokens=12, temperature=0,
                                          store=False, reasoning={"effort": "high"}, stream=True,
                                          include=["reasoning.encrypted_content"]))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "reasoning"]
    assert done and done[0].encrypted_content == item.encrypted_content
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", include=["file_search_call.results"])
    assert e.value.param == "include" and "file_search_call.results" in e.value.message


def test_langchain_bind_tools_and_structured_output(agent_server):
    pytest.importorskip("langchain_openai")
    from typing import Literal

    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class WeatherArgs(BaseModel):
        city: Literal["Paris", "Tokyo"]

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model="tiny", base_url=agent_server.url + "/v1", api_key="none", max_tokens=200,
                     temperature=0, max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert msg.tool_calls[0]["args"]["city"] in ("Paris", "Tokyo")
    city = llm.with_structured_output(City).invoke("Tell me about Paris.")
    assert isinstance(city, City)
    with pytest.raises(openai.BadRequestError):
        llm.bind_tools([get_weather], tool_choice="nope").invoke("x")


def test_reasoning_effort_reaches_a_template_that_reads_it(agent_server):
    """reasoning_effort (chat) and reasoning.effort (Responses) go to the chat template as vLLM passes
    them; test_openai_api checks the 400 where the template does not read it."""
    def chat_prompt(**kw) -> int:
        r = httpx.post(agent_server.url + "/v1/chat/completions", timeout=60,
                       json={"messages": USER, "max_tokens": 1, **kw})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    def responses_prompt(**kw) -> int:
        r = httpx.post(agent_server.url + "/v1/responses", timeout=60,
                       json={"input": USER[0]["content"], "max_output_tokens": 1, **kw})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"]

    plain, high = chat_prompt(), chat_prompt(reasoning_effort="high")
    assert high > plain
    assert responses_prompt(reasoning={"effort": "high"}) == high and responses_prompt() == plain
    r = httpx.post(agent_server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": USER, "max_tokens": 1, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


def test_truncate_prompt_tokens_on_both_endpoints(agent_server):
    """vLLM's truncate_prompt_tokens: prompts longer than the context (2,048 tokens here), as ids, text or a
    chat, are cut to their last k tokens instead of refused; echo shows the prompt the model read."""
    client = agent_server.client()
    ids = list(range(5, 105)) * 30
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2, echo=True,
                                  extra_body={"truncate_prompt_tokens": 7, "ignore_eos": True})
    shown = httpx.post(agent_server.url + "/detokenize", timeout=30, json={"tokens": ids[-7:]}).json()["prompt"]
    assert r.usage.prompt_tokens == 7 and r.choices[0].text.startswith(shown)
    t = client.completions.create(model="tiny", prompt="hello " * 3000, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 9})
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello " * 3000}],
                                       max_tokens=1, extra_body={"truncate_prompt_tokens": 11})
    assert (t.usage.prompt_tokens, c.usage.prompt_tokens) == (9, 11)
    for value, word in ((4096, "greater than the maximum context length (2048"), (0, "an integer >= 1, or -1")):
        bad = httpx.post(agent_server.url + "/v1/completions", timeout=30, json={
            "prompt": "x", "max_tokens": 1, "truncate_prompt_tokens": value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens", bad.text
        assert word in bad.json()["error"]["message"], bad.text


def test_return_tokens_as_token_ids_on_both_endpoints(agent_server):
    """vLLM's return_tokens_as_token_ids: the logprobs' tokens as "token_id:{id}", the ids those of the
    output (their decoding is its text), logprobs and text offsets as without it."""
    client = agent_server.client()
    kw = dict(model="tiny", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(messages=USER, logprobs=True, top_logprobs=2, **kw)
    as_ids = client.chat.completions.create(messages=USER, logprobs=True, top_logprobs=2, **{
        **kw, "extra_body": {**kw["extra_body"], "return_tokens_as_token_ids": True}})
    entries = as_ids.choices[0].logprobs.content
    ids = [int(e.token.removeprefix("token_id:")) for e in entries]
    text = httpx.post(agent_server.url + "/detokenize", timeout=30, json={"tokens": ids}).json()["prompt"]
    assert text == plain.choices[0].message.content == as_ids.choices[0].message.content
    # equal but for float rounding: the second request's prompt may come from the prefix cache the first
    # filled (a prefill of its last block alone), the first's from a whole prefill
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in plain.choices[0].logprobs.content],
                                                         abs=1e-5)
    assert all(t.token.startswith("token_id:") and bytes(t.bytes) == t.token.encode() for e in entries
               for t in e.top_logprobs)
    plain = client.completions.create(prompt="hello", logprobs=2, **kw)
    as_ids = client.completions.create(prompt="hello", logprobs=2, **{
        **kw, "extra_body": {**kw["extra_body"], "return_tokens_as_token_ids": True}})
    lp, lp_plain = as_ids.choices[0].logprobs, plain.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens) and lp.text_offset == lp_plain.text_offset
    assert all(key.startswith("token_id:") for top in lp.top_logprobs for key in top)
    assert lp.token_logprobs == pytest.approx(lp_plain.token_logprobs, abs=1e-5)


def test_bad_words_on_both_endpoints(agent_server):
    """vLLM's bad_words, tokenized by the API server (whose engine core may hold no tokenizer): a one-token
    word of the free output never comes, on either endpoint; the output leaves the free one where it would
    have; a bad list is refused by name."""
    client = agent_server.client()
    ids_of = {"logprobs": 0, "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}
    kw = dict(model="tiny", max_tokens=12, temperature=0)

    def completion_ids(**extra):
        body = {**ids_of, "extra_body": {**ids_of["extra_body"], **extra}}
        r = client.completions.create(prompt="hello", **kw, **body)
        return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    free = completion_ids()

    def one_token_word(j):
        text = httpx.post(agent_server.url + "/detokenize", timeout=30, json={"tokens": [free[j]]}).json()["prompt"]
        ids = httpx.post(agent_server.url + "/tokenize", timeout=30,
                         json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        return text if text and text == text.strip() and ids == [free[j]] else None
    j, word = next((j, w) for j in range(len(free)) if (w := one_token_word(j)) and free[j] not in free[:j])
    banned = completion_ids(bad_words=[word])
    assert banned[:j] == free[:j] and free[j] not in banned
    chat = client.chat.completions.create(messages=USER, logprobs=True, **kw, extra_body={
        **ids_of["extra_body"], "bad_words": [word]})
    assert all(e.token != f"token_id:{free[j]}" for e in chat.choices[0].logprobs.content)
    bad = httpx.post(agent_server.url + "/v1/completions", timeout=30, json={
        "prompt": "x", "max_tokens": 1, "bad_words": ["   "]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bad_words", bad.text
