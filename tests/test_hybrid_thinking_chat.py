"""A hybrid-thinking chat template shaped as SmolLM3-3B's, served in process with `--reasoning-parser qwen3
--enable-auto-tool-choice --tool-call-parser hermes`: thinking on by default and turned off by
`chat_template_kwargs` `{"enable_thinking": false}` or `/no_think` in the system message (the generation
prompt then closes an empty block), the date through `strftime_now`, the assistant's turns inside
transformers' `{% generation %}` tag, and `tools` shown in the system turn. The model's outputs are scripted
(a stand-in engine decodes the script's tokens as the engine's detokenizer does, under the request's
skip_special_tokens), on a tokenizer that marks `<think>` and `</think>` special."""
from __future__ import annotations

import json
import shutil

import pytest

# The structure of SmolLM3's template (not its text): the mode from enable_thinking (default on), overridden
# by a flag in the system message, which is shown without it; the generation prompt closes an empty
# thinking block when thinking is off.
TEMPLATE = (
    "{%- set thinking = enable_thinking if enable_thinking is defined else true -%}"
    "{%- set system = messages[0].content if messages[0].role == 'system' else '' -%}"
    "{%- if '/no_think' in system %}{% set thinking = false %}{% elif '/think' in system %}"
    "{% set thinking = true %}{% endif -%}"
    "<|im_start|>system\nmode: {{ 'think' if thinking else 'no_think' }}; year {{ strftime_now('%Y') }}\n"
    "{{ system.replace('/no_think', '').replace('/think', '').strip() }}"
    "{%- if tools %}\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}{% endif %}<|im_end|>\n"
    "{%- for m in messages if m.role != 'system' %}"
    "{%- if m.role == 'assistant' %}{% generation %}<|im_start|>assistant\n{{ m.content }}<|im_end|>\n"
    "{% endgeneration %}{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if not thinking %}<think>\n\n</think>\n{% endif %}"
    "{%- endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "hi"}]
THOUGHT = "<think>\nLet me see.\n</think>\nParis."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def chat(tokenizer_dir, tmp_path_factory):
    """POST to the app in process: (status, body or streamed deltas, the rendered prompt, skip_special_tokens)."""
    from transformers import AutoTokenizer

    from stand_in_engine import ScriptedEngine, post_chat
    from tokenmill.engine.tokenizer import Tokenizer
    from tokenmill.server.app import build_app
    from tokenmill.server.serving import ChatOptions

    path = tmp_path_factory.mktemp("hybrid") / "tokenizer"
    shutil.copytree(tokenizer_dir, path)
    hf = AutoTokenizer.from_pretrained(path)
    hf.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})    # special, still one token each
    hf.chat_template = TEMPLATE
    hf.save_pretrained(path)
    engine = ScriptedEngine(Tokenizer(str(path)), 1024)
    app = build_app(engine, chat=ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes",
                                             reasoning_parser="qwen3"))

    def post(body: dict, script: str = "", stream: bool = False):
        engine.script = script
        engine.seen.update(prompt=None)
        status, got = post_chat(app, {"model": "tiny", "messages": USER, **body}, stream)
        return status, got, engine.seen["prompt"], engine.seen.get("skip")
    post.engine = engine
    return post


def _joined(deltas: list[dict], field: str) -> str:
    return "".join(d.get(field) or "" for d in deltas)


def test_thinking_mode_switches_reach_the_prompt(chat):
    """On by default; off by chat_template_kwargs or by /no_think in the system message (which the template
    shows without the flag), the generation prompt then closing an empty block; /think there wins over the
    kwarg. The template's strftime_now and {% generation %} render."""
    import datetime
    year = str(datetime.date.today().year)
    for body, mode in (({}, "think"), ({"chat_template_kwargs": {"enable_thinking": False}}, "no_think"),
                       ({"messages": [{"role": "system", "content": "Be brief. /no_think"}, *USER]}, "no_think"),
                       ({"messages": [{"role": "system", "content": "/think"}, *USER],
                         "chat_template_kwargs": {"enable_thinking": False}}, "think")):
        status, _, prompt, _ = chat(body, "ok")
        assert status == 200 and f"mode: {mode}; year {year}\n" in prompt, prompt
        assert prompt.endswith("<|im_start|>assistant\n" + ("" if mode == "think" else "<think>\n\n</think>\n"))
        assert "/think" not in prompt.split("<|im_end|>")[0] and "/no_think" not in prompt
    status, _, prompt, _ = chat({"messages": [*USER, {"role": "assistant", "content": "yes"}, *USER]}, "ok")
    assert status == 200 and "<|im_start|>assistant\nyes<|im_end|>\n" in prompt


@pytest.mark.parametrize("stream", [False, True])
def test_special_think_tags_still_split_the_reasoning(chat, stream):
    """A tokenizer that marks <think> and </think> special: decoded under the default skip_special_tokens, the
    thinking came back as content, its tags gone. The reasoning parser keeps special tokens as the tool parser
    does, so the block is reasoning, streamed and not; with thinking off (the prompt closed the block) the
    reply is all content."""
    status, got, _, skip = chat({}, THOUGHT, stream)
    assert status == 200 and skip is False
    msg = {"reasoning_content": _joined(got, "reasoning_content"), "content": _joined(got, "content")} \
        if stream else got["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Let me see.", "Paris."), got
    status, got, _, _ = chat({"chat_template_kwargs": {"enable_thinking": False}}, "Paris.", stream)
    msg = {"reasoning_content": _joined(got, "reasoning_content") or None, "content": _joined(got, "content")} \
        if stream else got["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (None, "Paris."), got


def test_tools_reach_the_template_and_calls_follow_the_thinking(chat):
    """The request's tools reach the template as `tools`; a reply that thinks and then calls gives the
    thinking as reasoning and the hermes block as a call (finish_reason tool_calls), streamed and not."""
    status, body, prompt, _ = chat({"tools": [WEATHER]}, "<think>\nNeed the weather.\n</think>\n" + CALL)
    assert status == 200 and "\ntools: get_weather<|im_end|>" in prompt, prompt
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "Need the weather."
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_") and choice["message"]["content"] is None
    _, deltas, _, _ = chat({"tools": [WEATHER]}, "<think>\nNeed the weather.\n</think>\n" + CALL, stream=True)
    calls = [c for d in deltas for c in d.get("tool_calls") or ()]
    assert _joined(deltas, "reasoning_content") == "Need the weather." and not _joined(deltas, "content")
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}


def test_reasoning_effort_is_refused_by_a_template_with_a_generation_tag(chat):
    """The template reads enable_thinking, not reasoning_effort: a 400 that says so and names the kwarg. The
    {% generation %} tag (transformers') made the check give up and read the template as reading everything,
    and the effort was dropped without a word."""
    status, body, _, _ = chat({"reasoning_effort": "low"}, "ok")
    assert status == 400 and body["error"]["param"] == "reasoning_effort", body
    assert "does not read reasoning_effort" in body["error"]["message"]
    assert '{"enable_thinking": false}' in body["error"]["message"]


def test_a_thinking_budget_leaves_a_grammar_whole_where_thinking_is_off(chat):
    """Thinking off (the prompt closes an empty block), a JSON grammar holds the output from its first token,
    which can then open no block: the budget goes nowhere, so that the engine does not read it as leaving the
    grammar room for a block first (with thinking on, the grammar waits for the block and the budget counts it)."""
    json_object = {"response_format": {"type": "json_object"}, "thinking_token_budget": 4}
    status, _, _, _ = chat({**json_object, "chat_template_kwargs": {"enable_thinking": False}}, "{}")
    params = chat.engine.seen["params"]
    assert status == 200 and params.thinking_token_budget is None and params.structured_outputs.think_tags is None
    status, _, _, _ = chat(json_object, "<think>\nhm\n</think>\n{}")
    params = chat.engine.seen["params"]
    assert status == 200 and params.thinking_token_budget == 4 and params.structured_outputs.think_tags is not None
