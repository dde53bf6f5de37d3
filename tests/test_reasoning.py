"""Reasoning parsers on scripted outputs: the qwen3 rule, and streams that agree with `extract` under
any chunking. Also the order with the tool parser: a `<tool_call>` while thinking is not a call."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

import tokenmill
from tokenmill.server.reasoning import REASONING_PARSERS, DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from tokenmill.server.tool_parsers import HermesToolParser

QWEN3 = Qwen3ReasoningParser()
OPEN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"       # Thinking-2507, Nanbeige4.1
CLOSED_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking=False
PLAIN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def stream(parser, chunks, prompt=""):
    s = parser.new_stream(prompt)
    reasoning, content = [], []
    for piece in chunks:
        r, c = s.feed(piece)
        reasoning.append(r or "")
        content.append(c or "")
    r, c = s.finish()
    reasoning.append(r or "")
    content.append(c or "")
    return "".join(reasoning), "".join(content)


def test_registry():
    assert REASONING_PARSERS["qwen3"] is Qwen3ReasoningParser
    assert REASONING_PARSERS["deepseek_r1"] is DeepSeekR1ReasoningParser


@pytest.mark.parametrize("text,prompt,expected", [
    # the model opens the block itself (Qwen3-4B, thinking mode)
    ("<think>\nLet me see.\n</think>\n\nParis.", PLAIN_PROMPT, ("Let me see.", "Paris.")),
    # the template opened it: only </think> is generated
    ("Let me see.\n</think>\n\nParis.", OPEN_PROMPT, ("Let me see.", "Paris.")),
    ("<think>\nLet me see.</think>Paris.", OPEN_PROMPT, ("Let me see.", "Paris.")),
    # enable_thinking=False: closed in the prompt, everything is content, tags included
    ("Paris.", CLOSED_PROMPT, (None, "Paris.")),
    ("a</think>b", CLOSED_PROMPT, (None, "a</think>b")),
    ("Paris. <think>x</think>", PLAIN_PROMPT, (None, "Paris. <think>x</think>")),
    # cut by max_tokens mid-thought
    ("still thinking", OPEN_PROMPT, ("still thinking", None)),
    ("<think>still", PLAIN_PROMPT, ("still", None)),
    ("<think>\n\n</think>\n\n", PLAIN_PROMPT, (None, None)),
    ("", OPEN_PROMPT, (None, None)),
    ("  <thin", PLAIN_PROMPT, (None, "<thin")),
    ("思考中…</think>答案是巴黎。", OPEN_PROMPT, ("思考中…", "答案是巴黎。")),
])
def test_qwen3_extract(text, prompt, expected):
    assert QWEN3.extract(text, prompt) == expected
    assert stream(QWEN3, list(text), prompt) == tuple(x or "" for x in expected)


def test_deepseek_r1_starts_thinking_unless_the_prompt_closed_the_block():
    """deepseek_r1 starts inside the block, whether or not the prompt opened it; but a template that turned
    thinking off (Qwen3's and SmolLM3's close an empty block in the generation prompt) leaves an answer: it
    was all reasoning, content None."""
    r1 = DeepSeekR1ReasoningParser()
    assert r1.extract("abc</think>xyz") == ("abc", "xyz")
    assert r1.extract("abc</think>xyz", OPEN_PROMPT) == ("abc", "xyz")
    assert r1.extract("abc") == ("abc", None)
    assert r1.extract("Paris.", CLOSED_PROMPT) == (None, "Paris.")
    assert r1.extract("<think>abc</think>xyz", CLOSED_PROMPT) == ("abc", "xyz")
    assert stream(r1, list("Paris."), CLOSED_PROMPT) == ("", "Paris.")


def test_starts_in_reasoning_reads_the_last_tag():
    assert QWEN3.starts_in_reasoning(OPEN_PROMPT)
    assert not QWEN3.starts_in_reasoning(CLOSED_PROMPT)
    assert not QWEN3.starts_in_reasoning(PLAIN_PROMPT)
    # an earlier turn's thinking is closed; the new turn opens again
    assert QWEN3.starts_in_reasoning(CLOSED_PROMPT + "ok<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_partial_tags_are_held_back():
    s = QWEN3.new_stream(OPEN_PROMPT)
    assert s.feed("abc </th") == ("abc", None)      # trailing space and "</th" held
    assert s.feed("ink>") == (None, None)
    assert s.feed("\n\nPar") == (None, "Par")
    assert s.finish() == (None, None)
    s = QWEN3.new_stream(PLAIN_PROMPT)
    assert s.feed("<thi") == (None, None)           # may still be <think>
    assert s.feed("s is") == (None, "<this is")


FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "<th", "</thi", "think>",
             " ", "\n", "\n\n", "a", "b.", "中文", "😀", '{"name": "f", "arguments": {}}']


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join), st.data(),
       st.sampled_from([OPEN_PROMPT, CLOSED_PROMPT, PLAIN_PROMPT]),
       st.sampled_from(["qwen3", "deepseek_r1"]))
def test_stream_equals_extract(text, data, prompt, name):
    parser = REASONING_PARSERS[name]()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    reasoning, content = parser.extract(text, prompt)
    assert stream(parser, chunks, prompt) == (reasoning or "", content or "")
    assert stream(parser, list(text), prompt) == (reasoning or "", content or "")


TOOLS_IN_THOUGHT = ('I could call <tool_call>{"name": "f", "arguments": {}}</tool_call> here.</think>\n\n'
                    'Calling.\n<tool_call>\n{"name": "g", "arguments": {"q": "巴黎"}}\n</tool_call>')


def test_tool_call_inside_reasoning_is_not_a_call():
    reasoning, content = QWEN3.extract(TOOLS_IN_THOUGHT, OPEN_PROMPT)
    assert '<tool_call>{"name": "f"' in reasoning
    parsed = HermesToolParser().extract(content)
    assert [c.name for c in parsed.tool_calls] == ["g"]
    assert parsed.content == "Calling.\n"


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_chained_streams_equal_chained_extract(data):
    text = TOOLS_IN_THOUGHT
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    reasoning_stream, tool_stream = QWEN3.new_stream(OPEN_PROMPT), HermesToolParser().new_stream()
    reasoning, deltas = [], []
    for piece in chunks + [None]:
        r, c = reasoning_stream.feed(piece) if piece is not None else reasoning_stream.finish()
        reasoning.append(r or "")
        if c:
            deltas += tool_stream.feed(c)
    deltas += tool_stream.finish()
    expected_reasoning, expected_content = QWEN3.extract(text, OPEN_PROMPT)
    expected = HermesToolParser().extract(expected_content)
    assert "".join(reasoning) == expected_reasoning
    assert "".join(d.content for d in deltas if d.content) == expected.content
    assert [(c.name, c.arguments) for c in tool_stream.tool_calls] == \
        [(c.name, c.arguments) for c in expected.tool_calls]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from tokenmill.engine.tokenizer import Tokenizer
    return Tokenizer(tokenizer_dir)


@pytest.mark.parametrize("text,prompt,name,expected", [
    # thinking opened by the template: everything before </think>
    ("Let me see.\n</think>\n\nParis.", OPEN_PROMPT, "qwen3", "Let me see.\n"),
    # opened by the output: between the tags
    ("<think>\nLet me see.\n</think>\n\nParis.", PLAIN_PROMPT, "qwen3", "\nLet me see.\n"),
    ("  <think>a b</think>c", PLAIN_PROMPT, "qwen3", "a b"),
    # a <think> the template had already opened is dropped, as extract drops it
    ("<think>a b</think>c", OPEN_PROMPT, "qwen3", "a b"),
    # cut off while thinking: all of it
    ("still thinking", OPEN_PROMPT, "qwen3", "still thinking"),
    ("<think>still", PLAIN_PROMPT, "qwen3", "still"),
    # no block: nothing, whatever tags come later
    ("Paris.", CLOSED_PROMPT, "qwen3", ""),
    ("Paris. <think>x</think>", PLAIN_PROMPT, "qwen3", ""),
    ("a</think>b", CLOSED_PROMPT, "qwen3", ""),
    ("abc</think>xyz", PLAIN_PROMPT, "deepseek_r1", "abc"),
])
def test_reasoning_tokens_are_those_inside_the_block(tok, text, prompt, name, expected):
    from tokenmill.engine.tokenizer import think_tag_ids
    tags = think_tag_ids(tok, "--reasoning-parser")
    ids = tok.encode(text, add_special_tokens=False)
    assert tags[0] in ids or "<think>" not in text
    count = REASONING_PARSERS[name]().reasoning_tokens(ids, text, prompt, tags)
    assert count == len(tok.encode(expected, add_special_tokens=False)) and (count > 0) == bool(expected)


def test_a_tokenizer_without_think_tokens_is_refused():
    from tokenmill.engine.tokenizer import Tokenizer, think_tag_ids
    bundled = Tokenizer(os.path.join(os.path.dirname(tokenmill.__file__), "assets", "tiny"))
    with pytest.raises(ValueError, match=r"<think> as one token .* encodes <think> as \d+ tokens"):
        think_tag_ids(bundled, "--reasoning-parser")


def test_a_think_tag_in_an_earlier_turn_opens_no_block():
    """`last_turn` keeps what follows the prompt's last special token, so a user quoting `<think>` opens no
    block, while a template that opens one for the reply, or a continued assistant message, still does."""
    from tokenmill.server.reasoning import last_turn
    markers = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    quoted = "<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n"
    assert QWEN3.starts_in_reasoning(quoted)                        # the whole prompt misleads
    assert not QWEN3.starts_in_reasoning(last_turn(quoted, markers))
    assert QWEN3.extract("It opens a block.", last_turn(quoted, markers)) == (None, "It opens a block.")
    for prompt in (OPEN_PROMPT, quoted + "<think>\n", "<|im_start|>assistant\n<think>\nhmm"):
        assert QWEN3.starts_in_reasoning(last_turn(prompt, markers))
    assert not QWEN3.starts_in_reasoning(last_turn(CLOSED_PROMPT, markers))
    assert last_turn("no markers here", ()) == "no markers here"
