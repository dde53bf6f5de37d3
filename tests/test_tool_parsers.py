"""The tool-call parsers (hermes, llama3_json, pythonic, granite, phi4_mini_json) on scripted outputs, each one's stream against its
`extract` under any chunking, and the schemas that enforce tool_choice "required" / a named function."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from tokenmill.server.tool_choice import NamedCall, RequiredCalls, required_tools_schema
from tokenmill.server.tool_parsers import (TOOL_PARSERS, GraniteToolParser, HermesToolParser, Llama3JsonToolParser,
                                          Phi4MiniJsonToolParser, PythonicToolParser)

HERMES = HermesToolParser()
LLAMA3 = Llama3JsonToolParser()
PYTHONIC = PythonicToolParser()
GRANITE = GraniteToolParser()
PHI4 = Phi4MiniJsonToolParser()
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def call(name, arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n</tool_call>'


def run_stream(chunks, parser=HERMES):
    s = parser.new_stream()
    deltas = []
    for piece in chunks:
        deltas += s.feed(piece)
    deltas += s.finish()
    return s, deltas


def assert_stream_matches(text, chunks, parser=HERMES):
    expected = parser.extract(text)
    s, deltas = run_stream(chunks, parser)
    assert all((d.content is None) != (d.tool_call is None) for d in deltas)
    assert "".join(d.content for d in deltas if d.content is not None) == (expected.content or "")
    arguments, headers = {}, {}
    for d in deltas:
        if d.tool_call is None:
            continue
        i = d.tool_call["index"]
        if i not in headers:    # the first delta of a call names it and carries the id
            headers[i] = d.tool_call
            assert d.tool_call["type"] == "function" and d.tool_call["function"]["arguments"] == ""
        else:
            assert set(d.tool_call) == {"index", "function"} and set(d.tool_call["function"]) == {"arguments"}
        arguments[i] = arguments.get(i, "") + d.tool_call["function"]["arguments"]
    assert sorted(headers) == list(range(len(expected.tool_calls)))
    for i, c in enumerate(expected.tool_calls):
        assert headers[i]["function"]["name"] == c.name
        assert arguments[i] == c.arguments
        assert headers[i]["id"] == s.tool_calls[i].id
    assert [(c.name, c.arguments) for c in s.tool_calls] == [(c.name, c.arguments) for c in expected.tool_calls]


def test_registry():
    assert TOOL_PARSERS == {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                            "pythonic": PythonicToolParser, "granite": GraniteToolParser,
                            "phi4_mini_json": Phi4MiniJsonToolParser}


def test_single_call():
    out = HERMES.extract(WEATHER)
    assert out.content is None
    [c] = out.tool_calls
    assert (c.name, c.arguments) == ("get_weather", '{"city": "Paris"}')
    assert re.fullmatch(r"call_[0-9a-f]{24}", c.id)
    assert c.to_openai() == {"id": c.id, "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_parallel_calls_and_text_before():
    text = "Let me check both.\n" + WEATHER + "\n" + call("get_time", {"tz": "Europe/Paris"})
    out = HERMES.extract(text)
    assert out.content == "Let me check both.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
    assert len({c.id for c in out.tool_calls}) == 2


def test_no_call_is_plain_content():
    assert HERMES.extract("Hello <b>world</b>").content == "Hello <b>world</b>"
    assert HERMES.extract("  \n").content is None
    assert HERMES.extract("").tool_calls == []


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',    # bad JSON
    '<tool_call>["get_weather"]</tool_call>',                                        # not an object
    '<tool_call>{"arguments": {}}</tool_call>',                                      # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',                        # arguments not an object
    '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',                 # not JSON
    '<tool_call>{"name": "f", "arguments": {"x": -1e400}}</tool_call>',              # past a float: no JSON
    '<tool_call>' + "[" * 100000 + '</tool_call>',                                  # too deep
])
def test_malformed_block_stays_content(block):
    out = HERMES.extract("before " + block + WEATHER)
    assert out.content == "before " + block
    assert [c.name for c in out.tool_calls] == ["get_weather"]


def test_arguments_forms():
    [a, b, c] = HERMES.extract('<tool_call>{"name": "f"}</tool_call>'
                               '<tool_call>{"name": "g", "arguments": "{\\"x\\":1}"}</tool_call>'
                               '<tool_call>{"name":"h","arguments":{"s":"\\u00e9"}}</tool_call>').tool_calls
    assert (a.arguments, b.arguments, c.arguments) == ("{}", '{"x": 1}', '{"s": "é"}')


def test_unicode_and_nested_braces():
    args = {"城市": "北京", "note": "a } brace { and \"quotes\" and </tool_cal", "nested": {"l": [1, {"k": "}"}]}}
    out = HERMES.extract("好的。" + call("查询天气", args))
    [c] = out.tool_calls
    assert c.name == "查询天气" and json.loads(c.arguments) == args
    assert "北京" in c.arguments                      # ensure_ascii=False, as OpenAI sends it
    assert out.content == "好的。"


def test_unclosed_last_block():
    out = HERMES.extract('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert out.content is None and out.tool_calls[0].arguments == '{"x": 1}'
    out = HERMES.extract('ok <tool_call>\n{"name": "f", "argum')
    assert out.content == 'ok <tool_call>\n{"name": "f", "argum' and out.tool_calls == []


def test_partial_start_tag_is_held_back():
    s = HERMES.new_stream()
    assert [d.content for d in s.feed("Sure <tool")] == ["Sure "]
    assert s.feed("_ca") == []
    deltas = s.feed('ll>{"name": "f", "arguments": {}}</tool_call>')
    assert [d.tool_call["index"] for d in deltas] == [0, 0] and deltas[0].tool_call["function"]["name"] == "f"
    assert s.finish() == []
    s = HERMES.new_stream()
    assert [d.content for d in s.feed("a <tool")] == ["a "]
    assert [d.content for d in s.feed("box>")] == ["<toolbox>"]
    assert [d.content for d in s.feed("<")] == []
    assert [d.content for d in s.finish()] == ["<"]


def test_whitespace_only_content_is_never_streamed():
    _, deltas = run_stream(list("\n" + WEATHER + "\n\n" + WEATHER + "\n"))
    assert [d.content for d in deltas if d.content] == []
    assert len([d for d in deltas if d.tool_call]) == 4


def test_char_by_char():
    text = "先查一下。\n" + WEATHER + "\n" + call("f", {"s": "} {", "n": [1, 2]}) + "\nbye"
    assert_stream_matches(text, list(text))


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "_call>", "</tool", "<", ">", "\n", " ", "hi", "中文",
             '{"name": "f", "arguments": {"x": 1}}', '{"name": "天气", "arguments": {"城": "北京 }{"}}',
             '{"name": "g"}', '{"name": ', '"arguments": {', "}", '"', "[1]", "\\",
             "<|python_tag|>", "<|python", "_tag|>", ";", '{"name": "h", "parameters": {"s": "]\\""}}',
             "{", "[", "]", "(", ")", "'", "=", ",", "f(x=1)", "[f(x=1), g(s='a]', l=[1, {\"k\": None}])]",
             "[天气(城='北京')]", "g()", "x=y",
             "<|tool_call|>", "<|tool", "_call|>", "functools", "func", "tools", '[{"name": "f", "arguments": {}}]',
             '[{"name": "天气", "parameters": {"城": "北京 ]["}}, ', '{"name": "g", "arguments": {"x": [1]}}]']


@pytest.mark.parametrize("parser", [HERMES, LLAMA3, PYTHONIC, GRANITE, PHI4], ids=lambda p: type(p).__name__)
@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["", " ", "\n", "<|python_tag|>", "<|tool_call|>", "functools"]),
       st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join), st.data())
def test_stream_equals_extract(parser, lead, text, data):
    """Every parser's stream, at any chunking (one character at a time included), sends the content and
    the calls of its `extract`; the untagged formats decide at the output's start, hence the leads."""
    text = lead + text
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert_stream_matches(text, chunks, parser)
    assert_stream_matches(text, list(text), parser)


# --- llama3_json and pythonic: untagged formats ---------------------------------------------------------

def short_id(param):
    """A test's id of a parser (its class, shortened) or a text (its start)."""
    return type(param).__name__[:7] if hasattr(param, "extract") else param[:30] if isinstance(param, str) else None


def calls_of(out):
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def test_llama3_json_calls():
    """Llama 3.1's template asks for `{"name": ..., "parameters": ...}`; the model may open with <|python_tag|>
    and write several, `;`-separated; `arguments` is read too (vLLM's llama3_json)."""
    out = LLAMA3.extract('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert out.content is None and calls_of(out) == [("get_weather", {"city": "Paris"})]
    out = LLAMA3.extract('\n<|python_tag|>{"name": "f", "parameters": {"s": "} ;{"}}; {"name": "天气", '
                         '"arguments": {"城": "北京"}};\n')
    assert out.content is None and calls_of(out) == [("f", {"s": "} ;{"}), ("天气", {"城": "北京"})]
    assert out.tool_calls[1].arguments == '{"城": "北京"}'
    out = LLAMA3.extract('Checking. <|python_tag|>{"name": "f", "parameters": {}}\n{"name": "g"} Done.')
    assert out.content == "Checking.  Done." and [c.name for c in out.tool_calls] == ["f", "g"]


@pytest.mark.parametrize("text", [
    'The answer is {"name": "f", "parameters": {}}',               # no tag and not at the start: prose
    '{"result": 42}',                                                # a JSON answer that is no call
    '{"name": "f", "parameters": [1]}',                              # parameters not an object
    '{"name": "f", "parameters": {}, "arguments": {}}',             # both: which one is meant?
    '{"name": "f", "parameters": {"x": 1]}',                         # a bracket closing another's kind
    '{"name": "f", "parameters": {"x": NaN}}',
    '{"name": "f", "parameters": {"x": "\\ud83d"}}',               # no Unicode
    '<|python_tag|>brave_search.call(query="x")',                   # Llama 3.1's built-in tools: not JSON
    '<|python_tag|>{"name": "f", "parameters": {"x"',               # cut short by max_tokens
    '<|python_tag|>',
])
def test_llama3_json_non_calls_stay_content(text):
    assert_stream_matches(text, list(text), LLAMA3)
    out = LLAMA3.extract(text)
    assert out.tool_calls == [] and out.content == text


def test_llama3_json_text_after_a_malformed_object_stays_content():
    out = LLAMA3.extract('<|python_tag|>{"name": "f"}; {"name": 3}; {"name": "g"}')
    assert [c.name for c in out.tool_calls] == ["f"] and out.content == '; {"name": 3}; {"name": "g"}'


def test_pythonic_calls():
    """Llama 3.2's pythonic template: `[f(a=1), g(b="x")]`; literals become JSON, never evaluated."""
    text = ("[get_weather(city='Paris', days=[1, 2], at={'hour': -3, 'exact': None}, metric=True), "
            'get_time(zone="CET", point=(1.5, +2))]')
    out = PYTHONIC.extract(text)
    assert out.content is None and calls_of(out) == [
        ("get_weather", {"city": "Paris", "days": [1, 2], "at": {"hour": -3, "exact": None}, "metric": True}),
        ("get_time", {"zone": "CET", "point": [1.5, 2]})]
    out = PYTHONIC.extract("\n[查询(城市='北京 ]')]\nI asked.")
    assert calls_of(out) == [("查询", {"城市": "北京 ]"})] and out.content == "\n\nI asked."
    assert out.tool_calls[0].arguments == '{"城市": "北京 ]"}'
    assert calls_of(PYTHONIC.extract("[ping()]")) == [("ping", {})]


@pytest.mark.parametrize("text", [
    "Sure: [f(x=1)]",                     # not at the start
    "[1] Smith et al.", "[link](https://example.com)", "[]",
    "[f(x=g())]", "[f(x=y)]", "[f(x=1 + 1)]", "[f(x=lambda: 1)]", "[f(x=__import__('os'))]",   # not literals
    "[f(1)]", "[f(**kw)]", "[f(x=1, x=2)]", "[os.system(x='ls')]",   # no name for an argument, not a plain name
    "[f(x=1e400)]", "[f(x=1j)]", "[f(x=b'1')]", "[f(x={1: 2})]", "[f(x='\\ud83d')]",   # no JSON value
    "[f(x=1), 'text']", "[f(x=1)", "[f(x=1}]", "[" * 300 + "]" * 300,
], ids=lambda text: text[:40])
def test_pythonic_non_calls_stay_content(text):
    assert_stream_matches(text, list(text), PYTHONIC)
    out = PYTHONIC.extract(text)
    assert out.tool_calls == [] and out.content == text


def test_a_pythonic_list_is_parsed_an_item_at_a_time(monkeypatch):
    """`ast.parse` keeps the GIL for its whole call: a list of 175,000 calls (875 kB) parsed whole when it
    closed held the event loop ~4 s. Each item is parsed as it completes, so a piece costs what it adds."""
    import ast

    parsed, real_parse = [], ast.parse

    def parse(text, *args, **kw):
        parsed.append(len(text))
        return real_parse(text, *args, **kw)
    monkeypatch.setattr(ast, "parse", parse)
    text = "[" + ", ".join(f"f(x={i}, y='a, [b]')" for i in range(200)) + ", ]"
    s = PYTHONIC.new_stream()
    deltas = [d for i in range(0, len(text), 7) for d in s.feed(text[i:i + 7])] + s.finish()
    assert len(s.tool_calls) == 200 and len(deltas) == 400
    assert len(parsed) == 200 and max(parsed) < 40


@pytest.mark.parametrize("parser,text,content,calls", [
    # Granite 3.x's templates write a turn's calls as `<|tool_call|>` and their JSON list; `<tool_call>` opens
    # one too, and so does the output's start (vLLM's granite)
    (GRANITE, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", {"city": "Paris"})]),
    (GRANITE, ' <tool_call> [{"name": "f", "arguments": {"s": "] [ },"}}, {"name": "天气", '
              '"arguments": "{\\"城\\": \\"北京\\"}"}]\n', None, [("f", {"s": "] [ },"}), ("天气", {"城": "北京"})]),
    (GRANITE, '[{"name": "ping", "arguments": {}}]', None, [("ping", {})]),
    (GRANITE, 'Checking.\n<|tool_call|>[{"name": "f", "arguments": {}}] Done.<|tool_call|>[{"name": "g", '
              '"arguments": {"n": [1, {"k": null}]}}]', "Checking.\n Done.", [("f", {}), ("g", {"n": [1, {"k": None}]})]),
    # Phi-4-mini's tool prompt asks for `functools[{"name": ..., "arguments": ...}, ...]`, no closing marker;
    # "parameters" is read too (vLLM's phi4_mini_json)
    (PHI4, 'functools[{"name": "get_weather", "arguments": {"city": "Tokyo"}}]', None,
     [("get_weather", {"city": "Tokyo"})]),
    (PHI4, 'functools[\n  {"name": "f", "arguments": {"n": {"d": [1, "]"]}}},\n  {"name": "天气", "parameters": '
           '{"城": "北京"}}\n]', None, [("f", {"n": {"d": [1, "]"]}}), ("天气", {"城": "北京"})]),
    (PHI4, 'Let me check.\nfunctools[{"name": "f", "arguments": {}}]\nAnything else?',
     "Let me check.\n\nAnything else?", [("f", {})]),
], ids=lambda p: short_id(p))
def test_json_list_calls(parser, text, content, calls):
    """A JSON list of calls after its opening: the calls, their arguments as OpenAI sends them (not ASCII),
    the text around the list as content; streamed a character at a time alike."""
    out = parser.extract(text)
    assert out.content == content and calls_of(out) == calls
    assert [c.arguments for c in out.tool_calls] == [json.dumps(a, ensure_ascii=False) for _, a in calls]
    assert_stream_matches(text, list(text), parser)


GRANITE_NON_CALLS = [
    'The list [{"name": "f", "arguments": {}}]',                      # no opening and not at the start: prose
    '<|tool_call|>[{"name": "f", "arguments": {"x": }}]',              # bad JSON
    '<|tool_call|>[{"name": "f", "arguments": {}}, 3]',                # an item that is no call
    '<|tool_call|>[{"name": "f", "arguments": [1]}]',                  # arguments not an object
    '<|tool_call|>[{"name": "f", "arguments": {"x": "\\ud83d"}}]',   # no Unicode
    '<|tool_call|>[{"name": "f", "arguments": {"x": 1]}]',             # a bracket closing another's kind
    '<|tool_call|>{"name": "f", "arguments": {}}',                     # not a list
    '<|tool_call|>[]', '<|tool_call|>', '<|tool_call|>Sure.', '<|toolbox|>[1]',
    '<|tool_call|>[{"name": "f", "arguments": {"x"',                   # cut short by max_tokens
]


PHI4_NON_CALLS = [
    "Use functools.partial here.", "import functools", "functools",    # the module named in prose
    'functools{"name": "f"}',                                          # not a list
    '[{"name": "f", "arguments": {}}]',                                # no marker
    "functools[] This is just text", "functools[ This is just text ]",
    'functools[{"name": "f", "arguments": "not a dict"}]',
    'functools[{"name": "f", "arguments": {}, "parameters": {}}]',     # both: which one is meant?
    'functools[{"name": "f", "arguments": {"x": NaN}}]',
    'functools[{"name": "f", "arguments": {"x": 1}}',                  # cut short by max_tokens
]


@pytest.mark.parametrize("parser,text", [(GRANITE, t) for t in GRANITE_NON_CALLS] + [(PHI4, t) for t in PHI4_NON_CALLS],
                         ids=lambda p: short_id(p))
def test_json_list_non_calls_stay_content(parser, text):
    assert_stream_matches(text, list(text), parser)
    out = parser.extract(text)
    assert out.tool_calls == [] and out.content == text


def test_list_openings_split_across_pieces_never_leak():
    """An opening cut anywhere is held back until it is known; one that turns out to be no opening, or that
    no list follows, is sent as content."""
    text = 'Sure.<|tool_call|>[{"name": "f", "arguments": {"x": 1}}]'
    for cut in range(len("Sure."), len("Sure.<|tool_call|>[")):
        s = GRANITE.new_stream()
        first = s.feed(text[:cut])
        assert [d.content for d in first] == ["Sure."]
        deltas = s.feed(text[cut:]) + s.finish()
        assert [d.tool_call["function"] for d in deltas] == [{"name": "f", "arguments": ""}, {"arguments": '{"x": 1}'}]
    s = GRANITE.new_stream()
    assert [d.content for d in s.feed("a <|tool")] == ["a "] and [d.content for d in s.feed("box|>")] == ["<|toolbox|>"]
    assert s.feed("<|tool_call|>") == [] and s.feed(" ") == []
    assert "".join(d.content for d in s.feed("ok")) == "<|tool_call|> ok"
    s = PHI4.new_stream()
    assert [d.content for d in s.feed("Try func")] == ["Try "] and s.feed("tools") == []
    assert "".join(d.content for d in s.feed(".reduce")) == "functools.reduce"
    assert [d.content for d in s.feed(" functools[{")] == [" "]
    assert len(s.feed('"name": "f"}]')) == 2 and s.finish() == []


def test_untagged_streams_send_each_call_once_it_closes():
    s = LLAMA3.new_stream()
    assert s.feed('<|python_tag|>{"name": "f", "parameters": {"x": ') == []
    deltas = s.feed('1}}; {"name"')
    assert [d.tool_call["function"] for d in deltas] == [{"name": "f", "arguments": ""}, {"arguments": '{"x": 1}'}]
    assert s.feed(': "g"}') != [] and s.finish() == [] and [c.name for c in s.tool_calls] == ["f", "g"]
    s = LLAMA3.new_stream()
    assert [d.content for d in s.feed("Hi <|pyth")] == ["Hi "] and [d.content for d in s.feed("on>")] == ["<|python>"]
    s = PYTHONIC.new_stream()
    assert s.feed("[f(x=1), ") == [] and s.feed("g(y='])')") == []
    assert len(s.feed("]")) == 4 and [d.content for d in s.feed(" ok")] == [" ok"]


@pytest.mark.parametrize("parser,text,names", [
    (Llama3JsonToolParser, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                           '{"name": "get_time", "parameters": {}}', ["get_weather", "get_time"]),
    (PythonicToolParser, '[get_weather(city="Paris"), get_time()]', ["get_weather", "get_time"]),
    (GraniteToolParser, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                        '{"name": "get_time", "arguments": {}}]', ["get_weather", "get_time"]),
    (Phi4MiniJsonToolParser, 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                             '{"name": "get_time", "arguments": {}}]', ["get_weather", "get_time"]),
], ids=["llama3_json", "pythonic", "granite", "phi4_mini_json"])
def test_untagged_parsers_through_the_chat_message(parser, text, names):
    """The chat handler's reading of a choice (`ChoiceText`, whole and streamed) with each parser:
    tool_calls, no content, and one call without parallel_tool_calls."""
    from types import SimpleNamespace

    from tokenmill.server.chat import ChoiceText
    from tokenmill.server.protocol import ChatCompletionRequest
    serving = SimpleNamespace(reasoning_parser=None, tool_parser=parser, think_tags=None)
    tools = [{"type": "function", "function": {"name": n}} for n in names]
    for parallel, expected in ((None, names), (False, names[:1])):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                    "parallel_tool_calls": parallel})
        whole = ChoiceText(serving, req, "")
        message = whole.message(text)
        assert message["content"] is None and whole.called_tools
        assert [c["function"]["name"] for c in message["tool_calls"]] == expected
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
        streamed = ChoiceText(serving, req, "")
        parts = [p for i in range(0, len(text), 3) for p in streamed.feed(text[i:i + 3])] + streamed.finish()
        assert all(parts)           # no empty delta where a later call is dropped
        heads = [t for p in parts for t in p.get("tool_calls", []) if "id" in t]
        assert [t["function"]["name"] for t in heads] == expected and streamed.called_tools
        assert not any(p.get("content") for p in parts)


# --- tool_choice schemas ------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                    "required": ["city"]}}},
    {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
        "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}}},
    {"type": "function", "function": {"name": "ping"}},
]
NAMED = {"type": "function", "function": {"name": "book"}}


def validator(schema):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_required_schema_accepts_calls_of_the_tools_only():
    schema = required_tools_schema(TOOLS, "required")
    v = validator(schema)
    good = [{"name": "get_weather", "arguments": {"city": "巴黎"}}, {"name": "book", "arguments": {"item": {"n": 2}}},
            {"name": "ping", "arguments": {}}]
    assert v.is_valid(good)
    for bad in ([], [{"name": "nope", "arguments": {}}], [{"name": "book", "arguments": {"item": {"n": "x"}}}],
                [{"name": "get_weather", "arguments": {}}], [{"name": "ping"}]):
        assert not v.is_valid(bad), bad
    reader = RequiredCalls(TOOL_NAMES)
    _read(reader, [json.dumps(good, ensure_ascii=False)])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reader.calls] == \
        [(g["name"], g["arguments"]) for g in good]


def test_no_parallel_calls_means_one_item():
    v = validator(required_tools_schema(TOOLS, "required", parallel_tool_calls=False))
    assert v.is_valid([{"name": "ping", "arguments": {}}])
    assert not v.is_valid([{"name": "ping", "arguments": {}}] * 2)


def test_named_schema_is_the_function_parameters():
    schema = required_tools_schema(TOOLS, NAMED)
    v = validator(schema)
    assert v.is_valid({"item": {"n": 1}}) and not v.is_valid({"item": {}})


def test_schemas_compile_with_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts
    grammar = xgr.Grammar.from_json_schema(json.dumps(required_tools_schema(TOOLS, "required")))
    assert accepts(grammar, '[{"name": "book", "arguments": {"item": {"n": 3}}}]')
    assert not accepts(grammar, '[{"name": "book", "arguments": {"item": {"n": "3"}}}]')
    grammar = xgr.Grammar.from_json_schema(json.dumps(required_tools_schema(TOOLS, NAMED)))
    assert accepts(grammar, '{"item": {"n": 3}}')


@pytest.mark.parametrize("parameters", [None, {}, {"properties": {"q": {"type": "string"}}},
                                        {"type": ["object", "null"], "properties": {"q": {"type": "string"}}}])
def test_arguments_are_an_object_whatever_the_parameters_leave_out(parameters):
    """Absent or empty parameters, a schema without a type, or one whose type list admits others beside
    "object", still constrain the arguments to a JSON object, named and "required" alike: `{}` alone is the
    schema of any JSON value (null under "required" was read as the arguments `null}]`)."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts
    fn = {"name": "f"} if parameters is None else {"name": "f", "parameters": parameters}
    tools = [{"type": "function", "function": fn}]
    named = xgr.Grammar.from_json_schema(json.dumps(required_tools_schema(tools, {"type": "function",
                                                                                 "function": {"name": "f"}})))
    required = xgr.Grammar.from_json_schema(json.dumps(required_tools_schema(tools, "required")))
    good = '{"q": "x"}' if parameters else "{}"
    assert accepts(named, good) and accepts(required, '[{"name": "f", "arguments": %s}]' % good)
    for value in ('"SmolLM"', "3", "[1]", "null"):
        assert not accepts(named, value) and not accepts(required, '[{"name": "f", "arguments": %s}]' % value)


@pytest.mark.parametrize("tools,choice,message", [
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "not in tools"),
    ([], "required", "at least one tool"),
    (TOOLS, "auto", "tool_choice"),
    ([{"type": "retrieval"}], "required", "not a function tool"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/properties/x"}}}], "required",
     "unsupported \\$ref"),
])
def test_schema_errors(tools, choice, message):
    with pytest.raises(ValueError, match=message):
        required_tools_schema(tools, choice)


# --- tool_choice "auto" beside a JSON response format ----------------------------------------------------

ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}


def _auto_beside_format(tools, parser, parallel=True, schema=ANSWER):
    from tokenmill.server.protocol import ChatCompletionRequest
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tools": tools, "parallel_tool_calls": parallel,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    return req, req.structured_params(parser.call_form)


def _grammar(params):
    """The engine's grammar of a structural tag, as a matcher of strings takes it."""
    pytest.importorskip("xgrammar")
    from tokenmill.engine.structured_output import structural_tag_grammar
    return structural_tag_grammar(params.structural_tag, not params.disable_any_whitespace)


@pytest.mark.parametrize("parser", [HERMES, LLAMA3, GRANITE, PHI4], ids=["hermes", "llama3_json", "granite",
                                                                   "phi4_mini_json"])
@pytest.mark.parametrize("parallel", [True, False])
def test_auto_tools_beside_a_format_admit_calls_or_the_format_alone(parser, parallel):
    """Tools with tool_choice "auto" and a JSON response format: the output is the parser's calls (their
    arguments under the tools' schemas, one without parallel calls) or the format's JSON, in compact JSON; the
    parser reads the one as calls and leaves the other content."""
    from xgrammar.testing import _is_grammar_accept_string as accepts
    grammar = _grammar(_auto_beside_format(TOOLS, parser, parallel)[1])
    form = parser.call_form

    def calls(*items):
        return form.opening + form.separator.join(
            form.begin + json.dumps({"name": n, form.arguments_key: a}, ensure_ascii=False) + form.end
            for n, a in items) + form.closing
    one = calls(("get_weather", {"city": "巴黎", "unit": "c"}))
    two = calls(("book", {"item": {"n": 3}}), ("ping", {}))
    for text in (one, two) if parallel else (one,):
        assert accepts(grammar, text), text
        extracted = parser.extract(text)
        assert extracted.content is None and extracted.tool_calls
    assert accepts(grammar, '{"city": "Paris"}')
    assert parser.extract('{"city": "Paris"}') == type(parser.extract(""))('{"city": "Paris"}', [])
    for text in ([] if parallel else [two]) + [
            calls(("nope", {})), calls(("book", {"item": {"n": "3"}})), calls(("get_weather", {"unit": "c"})),
            '{"city":"Paris"}', '{"city": "Pa\tris"}', '{"town": "Paris"}', "Paris", "",
            '{"city": "Paris"}' + form.separator + one, one + '{"city": "Paris"}']:
        assert not accepts(grammar, text), text


def test_auto_tools_beside_a_format_key_the_grammar_by_both():
    from tokenmill.engine.structured_output import _key
    keys = {_key(_auto_beside_format(tools, HERMES, parallel, schema)[1])
            for tools in (TOOLS, TOOLS[:2]) for parallel in (True, False) for schema in (ANSWER, {"type": "object"})}
    assert len(keys) == 8
    assert _key(_auto_beside_format(TOOLS, HERMES)[1]) == _key(_auto_beside_format(TOOLS, HERMES)[1])


def test_a_pythonic_server_keeps_the_format_over_the_whole_output():
    assert PYTHONIC.call_form is None
    assert _auto_beside_format(TOOLS, PYTHONIC)[1].kind == "json"


def test_auto_tools_beside_a_format_name_the_field_of_a_bad_schema():
    """A schema refused before compiling, or that does not compile, is named by the field it came in: a
    tool's by "tools", the format's by "response_format"."""
    from tokenmill.sampling_params import SamplingParamError
    from tokenmill.server.protocol import UnsupportedValue
    unenforced = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
    broken = {"type": "object", "properties": {"a": {"type": "frobnicate"}}}
    tool = lambda parameters: [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    for tools, schema, field in ((tool(unenforced), ANSWER, "tools"), (TOOLS, unenforced, "response_format")):
        with pytest.raises(SamplingParamError) as e:
            _auto_beside_format(tools, HERMES, schema=schema)
        assert "uniqueItems" in str(e.value)
        req, _ = _auto_beside_format(TOOLS, HERMES)
        assert req.field_of(e.value.param) == field
    for tools, schema, field in ((tool(broken), ANSWER, "tools"), (TOOLS, broken, "response_format")):
        req, params = _auto_beside_format(tools, HERMES, schema=schema)
        with pytest.raises(SamplingParamError) as e:
            _grammar(params)
        assert "frobnicate" in str(e.value) and req.field_of(e.value.param) == field
    with pytest.raises(UnsupportedValue, match="unsupported \\$ref") as e:
        _auto_beside_format(tool({"$ref": "#/properties/x"}), HERMES)
    assert e.value.field == "tools"


def _read(reader, pieces):
    """The (index, name, arguments) pieces `reader` returns for `pieces` fed one after another, then finished."""
    out = [p for piece in pieces for p in reader.feed(piece)]
    return out + reader.finish()


TOOL_NAMES = [t["function"]["name"] for t in TOOLS]
REQUIRED_OUTPUT = json.dumps([
    {"name": "book", "arguments": {"item": {"n": 2}, "note": "a \"}\" brace, [x] and \\"}},
    {"name": "get_weather", "arguments": {"city": "巴黎", "days": [1, [2, {}]]}},
    {"name": "ping", "arguments": {}}], ensure_ascii=False)


@given(st.lists(st.integers(1, len(REQUIRED_OUTPUT) - 1), max_size=12))
@settings(max_examples=200, deadline=None)
def test_required_calls_read_alike_at_any_chunking(cuts):
    cuts = sorted(set(cuts))
    pieces = [REQUIRED_OUTPUT[a:b] for a, b in zip([0] + cuts, cuts + [len(REQUIRED_OUTPUT)])]
    reader = RequiredCalls(TOOL_NAMES)
    read = _read(reader, pieces)
    expected = json.loads(REQUIRED_OUTPUT)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reader.calls] == \
        [(e["name"], e["arguments"]) for e in expected]
    assert [name for _, name, _ in read if name is not None] == ["book", "get_weather", "ping"]
    for i, call in enumerate(reader.calls):        # the pieces add up to each call's arguments, as generated
        assert "".join(args for j, _, args in read if j == i) == call["function"]["arguments"]
        assert call["function"]["arguments"] in REQUIRED_OUTPUT and call["id"].startswith("call_")


def test_required_calls_cut_short_keep_what_was_generated():
    cut = REQUIRED_OUTPUT[:REQUIRED_OUTPUT.index('"city"') + 4]
    reader = RequiredCalls(TOOL_NAMES)
    _read(reader, [cut])
    assert [c["function"]["name"] for c in reader.calls] == ["book", "get_weather"]
    assert reader.calls[1]["function"]["arguments"] == '{"cit'
    for cut in ('[{"name": "ping", "argu', '[{"na', ""):     # no call begun: no calls (the text is content)
        reader = RequiredCalls(TOOL_NAMES)
        assert _read(reader, [cut]) == [] and reader.calls == []


def test_required_calls_read_heads_that_name_a_tool_only():
    """Text outside the grammar (after a thinking block's end spelled out in smaller tokens than its tag,
    where the reasoning parser hands text on before the grammar holds it) reached the reader: a head whose
    name was no JSON (an invalid escape) raised there, a 500 or a stream cut off; one holding an unpaired
    surrogate made a response no JSON encoder writes. Such heads, and those of no tool, are text."""
    junk = ('[{"name": "\\x", "arguments": {}}, {"name": "\\ud800", "arguments": {}}, '
            '{"name": "nope", "arguments": {}}, ')
    text = junk + REQUIRED_OUTPUT[1:]
    for step in (1, 7, len(text)):
        reader = RequiredCalls(TOOL_NAMES)
        _read(reader, [text[i:i + step] for i in range(0, len(text), step)])
        assert [c["function"]["name"] for c in reader.calls] == ["book", "get_weather", "ping"]
    # a head that never closes is given up once no tool's name can be that long: what is kept stays short
    reader = RequiredCalls(TOOL_NAMES)
    for _ in range(2000):
        reader.feed('{"name": "' if _ == 0 else "x" * 10)
    assert len(reader._head) < 100 and reader.calls == []
    assert _read(reader, ['"}, {"name": "ping", "arguments": {}}]'])[0][1] == "ping"


def test_required_tool_choice_after_a_spelled_out_thinking_end():
    from types import SimpleNamespace
    from tokenmill.server.chat import ChoiceText
    from tokenmill.server.protocol import ChatCompletionRequest
    from tokenmill.server.reasoning import Qwen3ReasoningParser
    serving = SimpleNamespace(reasoning_parser=Qwen3ReasoningParser, tool_parser=None, think_tags=None)
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                "tool_choice": "required"})
    text = 'I will end with </think> then [{"name": "\\x", "arguments": {}}, {"name": "ping", "arguments": {}}]'
    message = ChoiceText(serving, req, "<think>\n").message(text)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["ping"]
    streamed = ChoiceText(serving, req, "<think>\n")
    parts = [p for ch in text for p in streamed.feed(ch)] + streamed.finish()
    assert [t["function"]["name"] for p in parts for t in p.get("tool_calls", []) if "id" in t] == ["ping"]


def test_a_named_call_is_the_whole_output():
    reader = NamedCall("book")
    read = _read(reader, ['{"item"', "", ': {"n": 1}}'])
    assert read == [(0, "book", ""), (0, None, '{"item"'), (0, None, ': {"n": 1}}')]
    assert reader.calls[0]["function"] == {"name": "book", "arguments": '{"item": {"n": 1}}'}
    empty = NamedCall("ping")
    assert _read(empty, []) == [(0, "ping", "")] and empty.calls[0]["function"]["arguments"] == ""
    # a long call's pieces are kept apart until the output ends (the arguments grew by each piece: a copy of
    # the whole per token), then joined once
    reader = NamedCall("write")
    for i in range(20_000):
        reader.feed(f"{i} ")
    assert reader.calls[0]["function"]["arguments"] == ""
    assert reader.finish() == [] and reader.calls[0]["function"]["arguments"] == "".join(f"{i} " for i in range(20_000))

@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {"city": "Paris \\ud83d"}}',
                                  '{"name": "f\\udc00", "arguments": {}}'])
def test_a_block_with_an_unpaired_surrogate_escape_stays_content(body):
    """"\\ud83d" alone is JSON text but no Unicode: such arguments (or name) reached the response, which
    could not be encoded as UTF-8: a 500, or a stream cut after its first chunk. The block is now
    malformed, kept as content verbatim (ASCII), whole and streamed alike."""
    text = f"<tool_call>\n{body}\n</tool_call>"
    out = HERMES.extract(text)
    assert out.tool_calls == [] and out.content == text
    _, deltas = run_stream([text[:20], text[20:]])
    assert [d.tool_call for d in deltas if d.tool_call] == []
    assert "".join(d.content for d in deltas if d.content) == text
    good = HERMES.extract('<tool_call>\n{"name": "f", "arguments": {"e": "\\ud83d\\ude00"}}\n</tool_call>')
    assert good.tool_calls[0].arguments == '{"e": "\U0001F600"}'      # a pair is one character


@pytest.mark.parametrize("parameters,message", [
    ({"type": "string"}, 'must be a JSON Schema of type "object", got type "string"'),
    ({"type": ["string", "null"]}, 'got type \\["string", "null"\\]'),
    ({"type": "object", "$defs": "x"}, r"parameters.\$defs must be an object of schemas, got str"),
    ({"type": "object", "definitions": [1]}, "parameters.definitions must be an object of schemas, got list"),
])
def test_function_parameters_that_are_not_an_object_schema_are_refused(parameters, message):
    """A function's arguments are one JSON object (OpenAI refuses other schemas). A string schema under
    "required" decoded garbled calls (the later calls inside the first's arguments); $defs that were not
    an object raised AttributeError (a 500). Both endpoints' tools now refuse them, naming the type."""
    from pydantic import ValidationError

    from tokenmill.server.protocol import ChatCompletionRequest, UnsupportedValue
    from tokenmill.server.protocol.responses import ResponsesRequest
    for cls, tool in ((ChatCompletionRequest, {"type": "function", "function": {"name": "f", "parameters": parameters}}),
                      (ResponsesRequest, {"type": "function", "name": "f", "parameters": parameters})):
        with pytest.raises(ValidationError, match=message) as e:
            cls.model_validate({"messages" if cls is ChatCompletionRequest else "input": [
                {"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required"})
        cause = e.value.errors()[0]["ctx"]["error"]
        assert isinstance(cause, UnsupportedValue) and cause.field == "tools"
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": ["object", "null"]}}}]})


def test_a_field_of_another_union_branch_is_named_with_what_is_missing():
    """A Responses-style named tool_choice sent to chat ({"type": "function", "name": ...}) was refused as
    'Unknown or unsupported field(s): tool_choice.NamedToolChoice.name': a class name for a field, and
    nothing about the `function` it lacks."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from tokenmill.server.errors import describe_validation_error
    from tokenmill.server.protocol import ChatCompletionRequest
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "name": "f"}})
    message, param = describe_validation_error(RequestValidationError(e.value.errors()))
    assert message == "Unknown or unsupported field(s): tool_choice.name; tool_choice.function: Field required"
    assert param == "tool_choice.name"


def test_a_tool_of_another_type_than_function_is_named():
    """Chat tools and tool_choice of a type other than a function (a custom tool, a built-in one, an
    allowed_tools choice) are refused by their type, as the Responses endpoint refuses them (one shared check),
    not with a function's missing fields and the tool's own fields called unknown."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from tokenmill.server.errors import describe_validation_error
    from tokenmill.server.protocol import ChatCompletionRequest, TokenizeRequest
    function = {"type": "function", "function": {"name": "f"}}

    def error(cls=ChatCompletionRequest, **fields):
        with pytest.raises(ValidationError) as e:
            cls.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})
        return describe_validation_error(RequestValidationError(e.value.errors()))
    custom = {"type": "custom", "custom": {"name": "apply_patch", "format": {"type": "text"}}}
    assert error(tools=[function, custom]) == ("tool type 'custom' is not supported by tokenmill (only 'function')",
                                               "tools")
    assert error(tools=[{"type": "web_search"}])[0].startswith("tool type 'web_search' is not supported")
    assert error(TokenizeRequest, tools=[custom])[0].startswith("tool type 'custom' is not supported")
    message, param = error(tools=[function], tool_choice={"type": "allowed_tools",
                                                          "allowed_tools": {"mode": "auto", "tools": [function]}})
    assert "tool_choice type 'allowed_tools' is not supported" in message and param == "tool_choice"
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [function],
                                                 "tool_choice": {"type": "function", "function": {"name": "f"}}})


def test_required_schemas_leave_data_that_looks_like_a_ref_alone():
    """A const (or enum, default, examples) holding a "$ref" key is data: moving the tools' $defs rewrote
    it, so the output no longer matched the tool's own schema."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"const": {"$ref": "#/definitions/Pet"}}}, "required": ["p"],
        "examples": [{"$ref": "#"}]}}}]
    arguments = required_tools_schema(tools, "required")["items"]["anyOf"][0]["properties"]["arguments"]
    assert arguments["properties"]["p"]["const"] == {"$ref": "#/definitions/Pet"}
    assert arguments["examples"] == [{"$ref": "#"}]


def test_required_schemas_keep_defs_and_definitions_of_one_name_apart():
    """A schema may hold both `$defs` and `definitions`, each with a schema of the same name: moved to the
    root side by side, the second replaced the first, and every $ref to either read the one left."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": {"n": {"type": "integer"}}, "definitions": {"n": {"type": "string"}},
        "properties": {"i": {"$ref": "#/$defs/n"}, "s": {"$ref": "#/definitions/n"}}, "required": ["i", "s"]}}}]
    grammar = xgr.Grammar.from_json_schema(json.dumps(required_tools_schema(tools, "required")))
    assert accepts(grammar, '[{"name": "f", "arguments": {"i": 1, "s": "x"}}]')
    assert not accepts(grammar, '[{"name": "f", "arguments": {"i": "x", "s": 1}}]')


def test_required_schemas_rename_refs_under_properties_named_like_data_keywords():
    """A property (or a $defs entry) called "type", "enum" or "default" is a schema: its $refs were left
    unrenamed as if they were data, and did not resolve once the tool's $defs moved (a pydantic tool with a
    field `type: SomeEnum` was a 400 under "required")."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": {"Kind": {"enum": ["a", "b"]}, "enum": {"$ref": "#/$defs/Kind"}},
        "properties": {"type": {"$ref": "#/$defs/Kind"}, "default": {"$ref": "#/$defs/enum"}},
        "required": ["type", "default"]}}}]
    grammar = xgr.Grammar.from_json_schema(json.dumps(required_tools_schema(tools, "required")))
    assert accepts(grammar, '[{"name": "f", "arguments": {"type": "a", "default": "b"}}]')
    assert not accepts(grammar, '[{"name": "f", "arguments": {"type": "c", "default": "b"}}]')


# --- through the server ---------------------------------------------------------------------------------

# a template that shows the tools, as Granite's and Phi-4-mini's do (their text is not needed here)
TOOLS_TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ")


@pytest.mark.parametrize("parser,special,script", [
    ("granite", "<|tool_call|>", 'Let me look.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "巴黎"}}]'),
    ("phi4_mini_json", None, 'functools[{"name": "get_weather", "arguments": {"city": "巴黎"}}]'),
])
def test_list_parsers_serve_tool_calls(tokenizer_dir, tmp_path, parser, special, script):
    """Served with `--enable-auto-tool-choice --tool-call-parser granite` (or phi4_mini_json), a chat request
    with tools and tool_choice "auto" gets the model's calls as `tool_calls`, finish_reason "tool_calls", and
    the text before them as content, whole and streamed. Granite's `<|tool_call|>` is a special token of its
    tokenizer (as here): the output keeps it for the parser."""
    import shutil

    from transformers import AutoTokenizer

    from stand_in_engine import ScriptedEngine, post_chat
    from tokenmill.engine.tokenizer import Tokenizer
    from tokenmill.server.app import build_app
    from tokenmill.server.serving import ChatOptions
    path = tokenizer_dir
    if special is not None:
        path = tmp_path / "tokenizer"
        shutil.copytree(tokenizer_dir, path)
        hf = AutoTokenizer.from_pretrained(path)
        hf.add_special_tokens({"additional_special_tokens": [special]})
        hf.save_pretrained(path)
    engine = ScriptedEngine(Tokenizer(str(path)), 1024)
    engine.script = script
    app = build_app(engine, chat=ChatOptions(chat_template=TOOLS_TEMPLATE, enable_auto_tool_choice=True,
                                             tool_call_parser=parser))
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [weather],
            "tool_choice": "auto"}
    content = script[:script.index(special)] if special is not None else None
    status, got = post_chat(app, body)
    choice = got["choices"][0]
    assert status == 200 and choice["finish_reason"] == "tool_calls", got
    assert engine.seen["prompt"].startswith("tools: get_weather") and engine.seen["skip"] is False
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "巴黎"}'} and call["id"].startswith("call_")
    assert choice["message"]["content"] == content
    status, deltas = post_chat(app, body, stream=True)
    calls = [c for d in deltas for c in d.get("tool_calls") or ()]
    assert status == 200 and "".join(d.get("content") or "" for d in deltas) == (content or "")
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "巴黎"}'


def test_a_tool_parser_over_a_template_that_reads_no_tools_is_warned_of(tokenizer_dir, caplog):
    """A chat template that does not read `tools` (Phi-4-mini's own reads them from the system message) would
    drop every request's tools silently: the server says so at start, naming --chat-template."""
    from stand_in_engine import ScriptedEngine
    from tokenmill.engine.tokenizer import Tokenizer
    from tokenmill.server.app import build_app
    from tokenmill.server.serving import ChatOptions
    engine = ScriptedEngine(Tokenizer(str(tokenizer_dir)), 1024)
    no_tools = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
    for template, warned in ((no_tools, True), (TOOLS_TEMPLATE, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="tokenmill"):
            build_app(engine, chat=ChatOptions(chat_template=template, enable_auto_tool_choice=True,
                                               tool_call_parser="phi4_mini_json"))
        assert ("the chat template does not read `tools`" in caplog.text) == warned, caplog.text
        assert ("pass --chat-template" in caplog.text) == warned


def test_long_runs_are_held_in_pieces_not_one_growing_string():
    """A stream held what it had not decided in one string grown by each piece and looked at whole each
    time: a model's run of 32,000 whitespace tokens, or a call of 800 kB, held the event loop for seconds.
    Now what is held is pieces, and what is looked at again is the last few characters (an untagged
    format's open object or list: each new piece alone): the streams still equal the whole extraction."""
    from tokenmill.server.reasoning import Qwen3ReasoningParser
    call = '<tool_call>\n{"name": "write", "arguments": {"text": "' + "ab </tool" * 3000 + '"}}\n</tool_call>'
    listed = "[" + ", ".join('{"name": "f", "arguments": {"a": "%s"}}' % ("[{" * i) for i in range(300)) + "]"
    obj = '{"name": "write", "parameters": {"text": "' + "ab {[" * 5000 + '"}}; '
    for parser, text, bound in ((HermesToolParser(), call + " " * 20_000 + "done", 16),
                                (HermesToolParser(), " " * 20_000 + call, 16),
                                (GraniteToolParser(), " " * 20_000 + listed, 16),
                                (PythonicToolParser(), "[" + "f(a=1), " * 3000 + "g(b='x]')] done", 16),
                                (Llama3JsonToolParser(), obj * 3 + "done", 16)):
        whole = parser.extract(text)
        stream = parser.new_stream()
        deltas, longest = [], 0
        for i in range(0, len(text), 4):
            deltas += stream.feed(text[i:i + 4])
            longest = max(longest, len(stream._buf), len(getattr(stream, "_tail", "")))
        deltas += stream.finish()
        assert "".join(d.content or "" for d in deltas) == (whole.content or "")
        assert [d.tool_call["function"]["arguments"] for d in deltas if d.tool_call and "id" not in d.tool_call] \
            == [c.arguments for c in whole.tool_calls]
        assert longest < bound, (type(parser).__name__, longest)
    reasoning = Qwen3ReasoningParser()
    text = " " * 20_000 + "<think>" + "x \n" * 5000 + "</think>answer"
    stream = reasoning.new_stream("")
    parts = [stream.feed(text[i:i + 3]) for i in range(0, len(text) // 2, 3)]
    assert len(stream._buf) < 16
    parts += [stream.feed(text[i:i + 3]) for i in range(len(text) // 2 - len(text) // 2 % 3, len(text), 3)]
    parts.append(stream.finish())
    assert ("".join(r or "" for r, _ in parts), "".join(c or "" for _, c in parts)) == reasoning.extract(text)
