"""What the formats with no end tag share (`llama3_json` and the list formats): `_Brackets`, which finds where a
bracketed value closes, piece by piece; `_UntaggedStream`, the base of their streams; and `_extract_by_stream`,
their `extract`."""
from __future__ import annotations

import re

from tokenmill.server.tool_parsers.base import Delta, ExtractedToolCalls, ToolParser, _DeltaStream


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
    may open calls), which `_opened` takes over; in "rest" mode all is content; the format reads the others.

    While a bracketed value is open (the format's `_value_mode`), `_buf` has been scanned to its end and each
    new piece is scanned alone (`_scan_piece`) and kept in `_pieces`: they are joined to `_buf` once, when the
    value closes (or at `finish`), so that a long call costs its length, not its length per piece."""
    _value_mode = ""

    def __init__(self, openings: tuple[str, ...], mode: str):
        super().__init__()
        self._openings = openings
        self._buf = ""
        self._pieces: list[str] = []
        self._mode = mode
        self._held = 0                  # how much of `_buf` opened what is being read: content if no call follows
        self._closed: int | None = None     # where in `_buf` the value closed (-1: no value), once it has

    def feed(self, delta_text: str) -> list[Delta]:
        out: list[Delta] = []
        if self._mode == self._value_mode:
            self._pieces.append(delta_text)
            end = self._scan_piece(delta_text)
            if end is None:
                return out
            self._buf, self._pieces = "".join([self._buf, *self._pieces]), []
            self._closed = end if end < 0 else len(self._buf) - len(delta_text) + end
        else:
            self._buf += delta_text
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        self._buf, self._pieces = "".join([self._buf, *self._pieces]), []
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
        """`_step` in the format's own modes. In `_value_mode` it runs once the value has closed, where
        `_closed` says."""
        raise NotImplementedError

    def _scan_piece(self, text: str) -> int | None:
        """The open value's scan of `text`, its next piece: past the close in `text`, -1 where a bracket
        closes another kind's, None while it stays open."""
        raise NotImplementedError
