"""Tool-call parsers (`--tool-call-parser NAME`); the schemas that enforce `tool_choice` are in
`tool_choice.py`.

A parser turns the model's text into OpenAI `tool_calls` plus the remaining `content`. It runs on the
content left by the reasoning parser (`reasoning.py`), never on the reasoning itself.

`hermes` (Qwen3, Nanbeige4.1, Hermes) writes each call as a tagged JSON object, several in a row,
possibly after some text:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Rules, the same for `extract` and for a stream fed any chunking:
- A block runs from `<tool_call>` to the next `</tool_call>`, or to the end of the output if never closed.
- A block is a call when its body is a JSON object with a non-empty string `name` and `arguments` that
  is an object (or a string holding one, or absent: `{}`), every string in it Unicode (no unpaired
  surrogate escape). `arguments` is re-serialised with
  `json.dumps(..., ensure_ascii=False)`, as OpenAI sends it. Any other block stays in the content
  verbatim, tags included; parsing never raises.
- Content is all text outside call blocks, verbatim; None when it is only whitespace.

A stream buffers each block until it closes, then sends the call as two deltas in OpenAI's shape: the
header (`index`, `id`, `type`, `function.name`, `function.arguments: ""`) and the whole arguments
string. Sending no part of a call before its JSON is known to parse is what keeps streamed and
non-streamed answers identical: a malformed block turns into content, never into half a call.

`llama3_json` (JSON objects at the start of the output or after `<|python_tag|>`, Llama 3.1-3.3),
`pythonic` (a Python list of calls starting the output, Llama 3.2 / 4), `granite` (a JSON list of calls
after `<|tool_call|>`, IBM Granite 3.x) and `phi4_mini_json` (a JSON list of calls after `functools`,
Phi-4-mini) have no end tag: each reads its format with a stream (the last three with one `ListStream`),
and its `extract` is that stream fed the whole output, under the same rules on names, arguments and content.
"""
from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass, field


TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                      # a JSON object, serialised
    id: str = field(default_factory=new_tool_call_id)

    def to_openai(self) -> dict:
        """The entry of `message.tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallForm:
    """How a format writes calls, for a grammar to write them (`tool_choice.calls_or_format`): each call is
    `begin`, the JSON object {"name": ..., <arguments_key>: {...}}, then `end`; calls are apart by `separator`,
    all of them between `opening` and `closing` (a list's)."""
    begin: str
    end: str
    separator: str
    arguments_key: str
    opening: str = ""
    closing: str = ""


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class Delta:
    """One streamed piece: exactly one of `content` (text) or `tool_call` (an entry of OpenAI's
    `choices[].delta.tool_calls`) is set."""
    content: str | None = None
    tool_call: dict | None = None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _loads(text: str):
    """JSON text the model wrote, parsed; ValueError where it is not JSON or a string in it is not Unicode
    (an unpaired surrogate escape such as "\\ud83d": no UTF-8 response can carry it), or a number in it
    is past a float's range (1e400 parses as inf, which json.dumps would write as Infinity, no JSON)."""
    value = json.loads(text, parse_constant=_reject_constant)
    json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")    # UnicodeEncodeError is a ValueError
    return value


def _arguments_json(arguments) -> str | None:
    """The OpenAI `arguments` string for a parsed `arguments` value, or None if it is not an object."""
    if arguments is None:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def _json_call(body: str, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """The call a JSON object writes: a non-empty string "name" and its arguments under one of
    `argument_keys` (absent: {}); None for anything else, an object with two of those keys included."""
    try:
        obj = _loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    keys = [k for k in argument_keys if k in obj]
    if len(keys) > 1:
        return None
    arguments = _arguments_json(obj[keys[0]] if keys else None)
    return None if arguments is None else ToolCall(obj["name"], arguments)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolParser:
    """Base for formats that wrap each call in a start and an end tag. A format sets the tags and
    `parse_call`; one that is not tagged overrides `extract` and `new_stream`. `call_form`: how a grammar
    writes its calls, None where no JSON grammar can (pythonic's Python literals)."""
    start_tag: str
    end_tag: str
    call_form: CallForm | None = None

    def parse_call(self, body: str) -> ToolCall | None:
        """The call written in a block's body, or None if the body is not one."""
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedToolCalls:
        content, calls, pos = [], [], 0
        while (start := text.find(self.start_tag, pos)) >= 0:
            content.append(text[pos:start])
            body_at = start + len(self.start_tag)
            end = text.find(self.end_tag, body_at)
            body_end = len(text) if end < 0 else end
            stop = body_end if end < 0 else end + len(self.end_tag)
            call = self.parse_call(text[body_at:body_end])
            if call is None:
                content.append(text[start:stop])
            else:
                calls.append(call)
            pos = stop
        content.append(text[pos:])
        joined = "".join(content)
        return ExtractedToolCalls(joined if joined.strip() else None, calls)

    def new_stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class HermesToolParser(ToolParser):
    start_tag = TOOL_CALL_START
    end_tag = TOOL_CALL_END
    # as Qwen's and Hermes' templates write calls
    call_form = CallForm(TOOL_CALL_START + "\n", "\n" + TOOL_CALL_END, "\n", "arguments")

    def parse_call(self, body: str) -> ToolCall | None:
        return _json_call(body, ("arguments",))


class _DeltaStream:
    """The output side of a stream: content held back while it is only whitespace, and each call sent as
    two deltas in OpenAI's shape, its header (`index`, `id`, `type`, `function.name`, `function.arguments:
    ""`) and its whole arguments string. `tool_calls` lists the calls sent so far (a response with any
    ends with `finish_reason: "tool_calls"`)."""

    def __init__(self):
        self._pending_ws = ""           # content so far, while it is only whitespace
        self._content_started = False
        self.tool_calls: list[ToolCall] = []

    def _call(self, call: ToolCall, out: list[Delta]) -> None:
        index = len(self.tool_calls)
        self.tool_calls.append(call)
        out.append(Delta(tool_call={"index": index, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}))
        out.append(Delta(tool_call={"index": index, "function": {"arguments": call.arguments}}))

    def _content(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        if not self._content_started:
            self._pending_ws += text
            if not self._pending_ws.strip():
                return
            text, self._pending_ws, self._content_started = self._pending_ws, "", True
        out.append(Delta(content=text))

    def _content_before(self, text: str, openings: tuple[str, ...], out: list[Delta]) -> tuple[int, str | None]:
        """Sends `text` as content up to the first of `openings` in it, or up to where a possible start of one
        ends it; returns where the text not yet sent starts and the opening found there (None if none)."""
        found = min(((at, o) for o in openings if (at := text.find(o)) >= 0), default=None)
        cut = found[0] if found else len(text) - max((_partial_suffix(text, o) for o in openings), default=0)
        self._content(text[:cut], out)
        return cut, found[1] if found else None


class ToolCallStream(_DeltaStream):
    """Incremental `extract` for a tagged format: `feed(delta_text)` for each decoded piece, then
    `finish()`; both return the deltas now decided.

    Over a whole output the content deltas concatenate to `extract(text).content` ("" where that is
    None) and each call's argument pieces to its `arguments`. Held back until decided: a possible start
    tag at the end of the text, a block until its end tag, and content while it is only whitespace."""

    def __init__(self, parser: ToolParser):
        super().__init__()
        self._parser = parser
        self._buf = ""                  # outside a block: a partial start tag; inside: the body so far
        self._inside = False

    def feed(self, delta_text: str) -> list[Delta]:
        out: list[Delta] = []
        start_tag, end_tag = self._parser.start_tag, self._parser.end_tag
        searched = len(self._buf)
        self._buf += delta_text
        while True:
            if self._inside:
                end = self._buf.find(end_tag, max(0, searched - len(end_tag) + 1))
                if end < 0:
                    return out
                self._close_block(self._buf[:end], end_tag, out)
                self._buf = self._buf[end + len(end_tag):]
            else:
                start, tag = self._content_before(self._buf, (start_tag,), out)
                if tag is None:
                    self._buf = self._buf[start:]
                    return out
                self._buf, self._inside = self._buf[start + len(start_tag):], True
            searched = 0

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._inside:
            self._close_block(self._buf, "", out)
        else:
            self._content(self._buf, out)
        self._buf = ""
        return out

    def _close_block(self, body: str, end_tag: str, out: list[Delta]) -> None:
        self._inside = False
        call = self._parser.parse_call(body)
        if call is None:
            self._content(self._parser.start_tag + body + end_tag, out)
        else:
            self._call(call, out)


_CLOSER_OPENS = {")": "(", "]": "[", "}": "{"}


class _Brackets:
    """Where the bracketed value that a text starts with closes, read piece by piece: (, [ and { nest and
    close by kind, outside strings delimited by one of `quotes` (a backslash escapes the next character)."""

    def __init__(self, quotes: str):
        self._quotes = quotes
        self._special = re.compile("[" + re.escape("()[]{},\\" + quotes) + "]")
        self._open: list[str] = []
        self._quote: str | None = None
        self._escaped = False
        self.commas: list[int] = []     # where the outer value's own commas are (its items end), in scan order

    def scan(self, text: str, pos: int) -> int | None:
        """Past the closing bracket, once `text` (read so far up to `pos`) has it; -1 where a bracket
        closes another kind's (no value, whatever follows); None while open."""
        while True:
            if self._escaped:
                if pos >= len(text):
                    return None
                pos, self._escaped = pos + 1, False
            m = self._special.search(text, pos)
            if m is None:
                return None
            ch, pos = m.group(), m.end()
            if self._quote is not None:
                if ch == "\\":
                    self._escaped = True
                elif ch == self._quote:
                    self._quote = None
            elif ch in self._quotes:
                self._quote = ch
            elif ch == ",":
                if len(self._open) == 1:
                    self.commas.append(pos - 1)
            elif ch in "([{":
                self._open.append(ch)
            elif ch in _CLOSER_OPENS:
                if not self._open or self._open.pop() != _CLOSER_OPENS[ch]:
                    return -1
                if not self._open:
                    return pos


def _extract_by_stream(parser: ToolParser, text: str) -> ExtractedToolCalls:
    """`extract` of an untagged format: its stream fed the whole output at once, so that the two agree by
    construction (the stream decides nothing that a later piece could change)."""
    stream = parser.new_stream()
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.content for d in deltas if d.content is not None)
    return ExtractedToolCalls(content or None, stream.tool_calls)


class _UntaggedStream(_DeltaStream):
    """Base of the streams of untagged formats: `_buf` holds the text not yet decided, which `_step` reads
    for as long as it can decide something. In "content" mode text is content up to one of `openings` (what
    may open calls), which `_opened` takes over; in "rest" mode all is content; the format reads the others."""

    def __init__(self, openings: tuple[str, ...], mode: str):
        super().__init__()
        self._openings = openings
        self._buf = ""
        self._mode = mode
        self._held = 0                  # how much of `_buf` opened what is being read: content if no call follows

    def feed(self, delta_text: str) -> list[Delta]:
        out: list[Delta] = []
        self._buf += delta_text
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        self._content(self._buf, out)       # a partial opening, what opened no call, an unclosed object or list
        self._buf, self._mode = "", "rest"
        return out

    def _step(self, out: list[Delta]) -> bool:
        """Decide what the buffer's text allows; False once more text is needed."""
        buf = self._buf
        if self._mode == "rest":
            self._content(buf, out)
            self._buf = ""
            return False
        if self._mode == "content":
            at, opening = self._content_before(buf, self._openings, out)
            self._buf = buf[at:]
            if opening is None:
                return False
            self._opened(len(opening))
            return True
        return self._read(out)

    def _opened(self, held: int) -> None:
        """`_buf` now starts with an opening, `held` characters long."""
        raise NotImplementedError

    def _read(self, out: list[Delta]) -> bool:
        """`_step` in the format's own modes."""
        raise NotImplementedError


PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """`llama3_json` (Llama 3.1 / 3.2 / 3.3, whose chat templates ask for a JSON call): one or more JSON
    objects `{"name": ..., "parameters": {...}}` (or `"arguments"`), separated by `;` and/or whitespace,
    where the output starts (after whitespace) or after `<|python_tag|>`:

        <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}

    An object is a call by `parse_call`; the first one that is not (bad JSON, no name, a bracket closing
    another's kind) and everything after it stays content verbatim, as does text before the tag, text after
    the last call, and a tag or separator that no call follows. A stream sends each call once its object
    closes; a reply that starts with `{` is held back until its object closes."""
    # the "parameters" Llama's templates ask for
    call_form = CallForm("", "", "; ", "parameters")

    def parse_call(self, body: str) -> ToolCall | None:
        return _json_call(body, ("parameters", "arguments"))

    def extract(self, text: str) -> ExtractedToolCalls:
        return _extract_by_stream(self, text)

    def new_stream(self) -> Llama3JsonStream:
        return Llama3JsonStream(self)


class Llama3JsonStream(_UntaggedStream):
    """`llama3_json`, read piece by piece. In "call" mode `_buf`'s first `_held` characters are what opened
    the call (a tag, a separator)."""

    def __init__(self, parser: Llama3JsonToolParser):
        super().__init__((PYTHON_TAG,), "start")    # start | content | call | object | after_call | rest
        self._parser = parser
        self._separated = False     # "call" mode after a separator, not a tag
        self._object: _Brackets | None = None
        self._scanned = 0

    def finish(self) -> list[Delta]:
        if self._mode == "call" and self._separated and not self._buf[self._held:].strip():
            self._buf = ""                  # a separator after the last call
        return super().finish()

    def _opened(self, held: int) -> None:
        self._mode, self._held, self._separated = "call", held, False

    def _read(self, out: list[Delta]) -> bool:
        buf, mode = self._buf, self._mode
        if mode == "object":
            end = self._object.scan(buf, self._scanned)
            if end is None:
                self._scanned = len(buf)
                return False
            call = self._parser.parse_call(buf[self._held:end]) if end > 0 else None
            if call is None:            # this object, what opened it and all that follows are content
                self._mode = "rest"
                return True
            self._call(call, out)
            self._buf, self._mode = buf[end:], "after_call"
            return True
        # start, call, after_call: whitespace, then an object (or after a call, a separator) or other text
        at = self._held if mode == "call" else 0
        first = len(buf) - len(buf[at:].lstrip())
        if first == len(buf):
            if mode == "start":
                self._content(buf, out)
                self._buf = ""
            return False
        if mode == "start":             # leading whitespace is content (held while nothing else came)
            self._content(buf[:first], out)
            self._buf, buf, first = buf[first:], buf[first:], 0
        if buf[first] == "{":
            self._mode, self._object, self._scanned, self._held = "object", _Brackets('"'), first, first
        elif mode == "after_call" and buf[first] == ";":
            self._mode, self._held, self._separated = "call", first + 1, True
        else:
            self._mode = "content"      # what opened a call that did not come is content, as is the rest
            if mode == "call":
                self._content(buf[:self._held], out)
                self._buf = buf[self._held:]
        return True


def _python_literal(node: ast.expr):
    """The JSON value of a Python literal: a string, a number (signed), True / False / None, a list or
    tuple, a dict of string keys. ValueError for anything else (a name, a call, an operation): nothing in
    the model's output is evaluated."""
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (str, bool, int, float)):
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_python_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) and type(k.value) is str for k in node.keys):
            raise ValueError("a dict key that is not a string")
        return {k.value: _python_literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError(f"not a literal: {type(node).__name__}")


class _ListToolParser(ToolParser):
    """Base of the formats that write their calls as one list, read by `ListStream`: after one of `openings`
    (and whitespace), or where the output starts (after whitespace) if `list_at_start`, a `[` opens the list,
    whose strings are delimited by one of `quotes`; `parse_call` reads one item of it."""
    openings: tuple[str, ...] = ()
    list_at_start = True
    quotes = '"'

    def extract(self, text: str) -> ExtractedToolCalls:
        return _extract_by_stream(self, text)

    def new_stream(self) -> ListStream:
        return ListStream(self)


class PythonicToolParser(_ListToolParser):
    """`pythonic` (Llama 3.2 / 4 and others whose template asks for a Python list of calls): the output
    starts (after whitespace) with a list of calls of keyword arguments whose values are literals:

        [get_weather(city="Paris", days=[1, 2]), get_time(zone='CET', dst=True)]

    Each item is read with `ast.parse` once it completes (a comma of the list's own ends it), never
    evaluated; the list holds calls when every item is `name(k=literal, ...)` with distinct keywords
    (`_python_literal`) and JSON arguments (no inf or nan, every string Unicode). Otherwise, and where the
    output does not start with `[`, it stays content verbatim; text after a list of calls is content. A
    stream holds the list back until it closes (a bracket that closes another kind's ends the wait:
    content), then sends all its calls."""
    quotes = "'\""

    def parse_call(self, item: str) -> ToolCall | None:
        """The call that one item of the list is, or None. Each item is parsed alone, as it completes: a list
        parsed whole held the event loop in `ast.parse` (one call that keeps the GIL) ~4 s for 175,000
        calls in 875 kB."""
        try:
            node = ast.parse("(" + item + "\n)", mode="eval").body
            if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args
                    or any(k.arg is None for k in node.keywords)
                    or len({k.arg for k in node.keywords}) < len(node.keywords)):
                return None
            arguments = json.dumps({k.arg: _python_literal(k.value) for k in node.keywords},
                                   ensure_ascii=False, allow_nan=False)
            arguments.encode("utf-8")       # UnicodeEncodeError (a ValueError): a lone surrogate
            return ToolCall(node.func.id, arguments)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None


class ListStream(_UntaggedStream):
    """A list format (`_ListToolParser`) read piece by piece. Text before an opening is content; a list is
    held in `_buf` until it closes, then sent as its calls when every item is one (the last item may be empty
    after a comma, as Python allows), after which the search for an opening goes on. A list that is not all
    calls (or none), a bracket closing another's kind and an unclosed list stay content, opening included,
    with all that follows; so does an opening that no `[` follows, and the search goes on past it. In "opened"
    and "list" mode `_buf`'s first `_held` characters are the opening and the whitespace after it."""

    def __init__(self, parser: _ListToolParser):
        # start | content | opened | list | rest
        super().__init__(parser.openings, "start" if parser.list_at_start else "content")
        self._parser = parser
        self._list: _Brackets | None = None
        self._scanned = 0
        self._item = 0                  # where the list's next item starts in `_buf` (past its "[" or a comma)
        self._calls: list[ToolCall] | None = None   # its items read so far; None once one is not a call

    def _opened(self, held: int) -> None:
        self._mode, self._held = "opened", held

    def _read(self, out: list[Delta]) -> bool:
        buf, mode = self._buf, self._mode
        if mode == "list":
            return self._scan(out)
        # start, opened: whitespace, then the list or other text
        at = self._held if mode == "opened" else 0
        first = len(buf) - len(buf[at:].lstrip())
        if first == len(buf):
            return False
        if mode == "start":             # leading whitespace is content, before a list too
            self._content(buf[:first], out)
            self._buf, buf, first = buf[first:], buf[first:], 0
        if buf[first] == "[":
            self._mode, self._held, self._list = "list", first, _Brackets(self._parser.quotes)
            self._scanned, self._item, self._calls = first, first + 1, []
        else:                           # what opened no list is content; an opening may follow it
            self._content(buf[:first], out)
            self._buf, self._mode = buf[first:], "content"
        return True

    def _scan(self, out: list[Delta]) -> bool:
        buf = self._buf
        end = self._list.scan(buf, self._scanned)
        for comma in self._list.commas:
            self._read_item(buf[self._item:comma], last=False)
            self._item = comma + 1
        self._list.commas.clear()
        if end is None:
            self._scanned = len(buf)
            return False
        if end > 0:
            self._read_item(buf[self._item:end - 1], last=True)
        if end > 0 and self._calls:
            for call in self._calls:
                self._call(call, out)
            self._buf, self._mode = buf[end:], "content"
        else:
            self._mode = "rest"
        return True

    def _read_item(self, item: str, last: bool) -> None:
        """One item of the list, as the parser's `parse_call` reads it."""
        if self._calls is None:
            return
        if not item.strip() and last and self._calls:
            return
        call = self._parser.parse_call(item)
        if call is None:
            self._calls = None
        else:
            self._calls.append(call)


class _JsonListToolParser(_ListToolParser):
    """A JSON list of objects `{"name": ..., <one of argument_keys>: {...}}`, each item a call as `_json_call`
    reads it; the list is calls when every item is one."""
    argument_keys: tuple[str, ...] = ("arguments",)

    def parse_call(self, item: str) -> ToolCall | None:
        return _json_call(item, self.argument_keys)


GRANITE_TOOL_CALL = "<|tool_call|>"


class GraniteToolParser(_JsonListToolParser):
    """`granite` (IBM Granite 3.x instruct, whose templates write a turn's calls as `<|tool_call|>` and their
    JSON list): a JSON list of calls after `<|tool_call|>` (a special token of Granite's tokenizers) or
    `<tool_call>` (as some Granite 3.0 / 3.1 outputs have it), or alone where the output starts, as vLLM's
    `granite` reads it:

        <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]

    Text before the opening and after the list is content (vLLM's parser keeps the whole output as content
    when any comes with the list)."""
    openings = (GRANITE_TOOL_CALL, TOOL_CALL_START)
    call_form = CallForm("", "", ", ", "arguments", opening=GRANITE_TOOL_CALL + "[", closing="]")


class Phi4MiniJsonToolParser(_JsonListToolParser):
    """`phi4_mini_json` (Phi-4-mini-instruct, whose tool prompt asks for a JSON list after a `functools`
    marker and none after it): a JSON list of calls after `functools`, anywhere in the text, objects
    `{"name": ..., "arguments": {...}}` (or `"parameters"`, as vLLM's parser reads too):

        Let me check. functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]

    Text before `functools` and after the list is content (vLLM's parser drops it where calls came), and a
    `functools` that no list follows (the Python module named in prose) is content."""
    openings = ("functools",)
    list_at_start = False
    argument_keys = ("arguments", "parameters")
    call_form = CallForm("", "", ", ", "arguments", opening="functools[", closing="]")


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                                              "pythonic": PythonicToolParser, "granite": GraniteToolParser,
                                              "phi4_mini_json": Phi4MiniJsonToolParser}
