"""`llama3_json` (Llama 3.1-3.3): JSON call objects where the output starts or after `<|python_tag|>`."""
from __future__ import annotations

from tokenmill.server.tool_parsers.base import CallForm, Delta, ExtractedToolCalls, ToolCall, ToolParser, _json_call
from tokenmill.server.tool_parsers.untagged import _Brackets, _UntaggedStream, _extract_by_stream


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
    the call (a tag, a separator); "object" mode reads the object that starts at `_held`."""
    _value_mode = "object"

    def __init__(self, parser: Llama3JsonToolParser):
        super().__init__((PYTHON_TAG,), "start")    # start | content | call | object | after_call | rest
        self._parser = parser
        self._separated = False     # "call" mode after a separator, not a tag
        self._object: _Brackets | None = None

    def finish(self) -> list[Delta]:
        if self._mode == "call" and self._separated and not self._buf[self._held:].strip():
            self._buf = ""                  # a separator after the last call
        return super().finish()

    def _opened(self, held: int) -> None:
        self._mode, self._held, self._separated = "call", held, False

    def _read(self, out: list[Delta]) -> bool:
        buf, mode = self._buf, self._mode
        if mode == "object":
            end, self._closed = self._closed, None
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
            self._mode, self._object, self._held = "object", _Brackets('"'), first
            self._closed = self._object.scan(buf, first)
            return self._closed is not None
        elif mode == "after_call" and buf[first] == ";":
            self._mode, self._held, self._separated = "call", first + 1, True
        else:
            self._mode = "content"      # what opened a call that did not come is content, as is the rest
            if mode == "call":
                self._content(buf[:self._held], out)
                self._buf = buf[self._held:]
        return True

    def _scan_piece(self, text: str) -> int | None:
        return self._object.scan(text, 0)
