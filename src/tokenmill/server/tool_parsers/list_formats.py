"""The formats that write a turn's calls as one list, each read by `ListStream`: `pythonic` (a Python list of
calls), `granite` and `phi4_mini_json` (a JSON list of call objects after an opening)."""
from __future__ import annotations

import ast
import json

from tokenmill.server.tool_parsers.base import CallForm, Delta, ExtractedToolCalls, ToolCall, ToolParser, _json_call
from tokenmill.server.tool_parsers.hermes import TOOL_CALL_START
from tokenmill.server.tool_parsers.untagged import _Brackets, _UntaggedStream, _extract_by_stream


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
    held until it closes, each item read as the list's own comma ends it, then sent as its calls when every
    item is one (the last item may be empty after a comma, as Python allows), after which the search for an
    opening goes on. A list that is not all calls (or none), a bracket closing another's kind and an unclosed
    list stay content, opening included, with all that follows; so does an opening that no `[` follows, and
    the search goes on past it. In "opened" mode `_buf`'s first `_held` characters are the opening and the
    whitespace after it."""
    _value_mode = "list"

    def __init__(self, parser: _ListToolParser):
        # start | content | opened | list | rest
        super().__init__(parser.openings, "start" if parser.list_at_start else "content")
        self._parser = parser
        self._list: _Brackets | None = None
        self._item: list[str] = []      # the pieces of the list's item not yet ended
        self._calls: list[ToolCall] | None = None   # its items read so far; None once one is not a call

    def _opened(self, held: int) -> None:
        self._mode, self._held = "opened", held

    def _read(self, out: list[Delta]) -> bool:
        buf, mode = self._buf, self._mode
        if mode == "list":
            end, self._closed = self._closed, None
            if end > 0 and self._calls:
                for call in self._calls:
                    self._call(call, out)
                self._buf, self._mode = buf[end:], "content"
            else:
                self._mode = "rest"
            return True
        # start, opened: whitespace, then the list or other text
        at = self._held if mode == "opened" else 0
        first = len(buf) - len(buf[at:].lstrip())
        if first == len(buf):
            if mode == "start":         # content (held while only whitespace) now: `_buf` stays short
                self._content(buf, out)
                self._buf = ""
            return False
        if mode == "start":             # leading whitespace is content, before a list too
            self._content(buf[:first], out)
            self._buf, buf, first = buf[first:], buf[first:], 0
        if buf[first] == "[":
            self._mode, self._list, self._item, self._calls = "list", _Brackets(self._parser.quotes), [], []
            end = self._scan_text(buf[first:], 1)
            self._closed = end if end is None or end < 0 else first + end
            return self._closed is not None
        # what opened no list is content; an opening may follow it
        self._content(buf[:first], out)
        self._buf, self._mode = buf[first:], "content"
        return True

    def _scan_piece(self, text: str) -> int | None:
        return self._scan_text(text, 0)

    def _scan_text(self, text: str, start: int) -> int | None:
        """Scans `text`, the list's next piece, whose item text starts at `start`: reads each item that ends
        in it; past the list's close in `text` (-1: a bracket closing another kind's), None while open."""
        end = self._list.scan(text, 0)
        for comma in self._list.commas:
            self._item.append(text[start:comma])
            self._read_item("".join(self._item), last=False)
            self._item, start = [], comma + 1
        self._list.commas.clear()
        if end is None:
            self._item.append(text[start:])
        elif end > 0:
            self._item.append(text[start:end - 1])
            self._read_item("".join(self._item), last=True)
        return end

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
