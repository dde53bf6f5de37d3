"""What every tool-call format shares: the call and delta types, reading the JSON the model wrote, `ToolParser`
(whose own `extract` and stream, `ToolCallStream`, read a tagged format: a block a call) and `_DeltaStream`, the
output side of every format's stream. The guarantees of all formats are in the package's docstring."""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field


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


def partial_suffix(text: str, tag: str) -> int:
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


class _DeltaStream:
    """The output side of a stream: content held back while it is only whitespace, and each call sent as
    two deltas in OpenAI's shape, its header (`index`, `id`, `type`, `function.name`, `function.arguments:
    ""`) and its whole arguments string. `tool_calls` lists the calls sent so far (a response with any
    ends with `finish_reason: "tool_calls"`)."""

    def __init__(self):
        self._pending_ws: list[str] = []    # content so far, while it is only whitespace
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
            self._pending_ws.append(text)
            if text.isspace():          # each piece looked at once: a long run of whitespace costs its length
                return
            text, self._pending_ws, self._content_started = "".join(self._pending_ws), [], True
        out.append(Delta(content=text))

    def _content_before(self, text: str, openings: tuple[str, ...], out: list[Delta]) -> tuple[int, str | None]:
        """Sends `text` as content up to the first of `openings` in it, or up to where a possible start of one
        ends it; returns where the text not yet sent starts and the opening found there (None if none)."""
        found = min(((at, o) for o in openings if (at := text.find(o)) >= 0), default=None)
        cut = found[0] if found else len(text) - max((partial_suffix(text, o) for o in openings), default=0)
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
        self._buf = ""                  # outside a block: a partial start tag
        self._inside = False
        # inside a block: its body's pieces (joined once, at its end) and the body's last characters, where
        # an end tag split between pieces begins; a long call costs its length, not its length per piece
        self._body: list[str] = []
        self._tail = ""

    def feed(self, delta_text: str) -> list[Delta]:
        out: list[Delta] = []
        start_tag, end_tag = self._parser.start_tag, self._parser.end_tag
        text = delta_text
        while True:
            if self._inside:
                window = self._tail + text
                end = window.find(end_tag)
                if end < 0:
                    self._body.append(text)
                    self._tail = window[max(0, len(window) - len(end_tag) + 1):]
                    return out
                held = len(self._tail)          # the end tag starts `held - end` characters back in the body
                body = "".join(self._body)
                body = body + text[:end - held] if end >= held else body[:len(body) - (held - end)]
                self._body, self._tail = [], ""
                self._close_block(body, end_tag, out)
                text = window[end + len(end_tag):]
            else:
                buf = self._buf + text
                start, tag = self._content_before(buf, (start_tag,), out)
                if tag is None:
                    self._buf = buf[start:]
                    return out
                self._buf, self._inside, text = "", True, buf[start + len(start_tag):]

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._inside:
            body, self._body, self._tail = "".join(self._body), [], ""
            self._close_block(body, "", out)
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
