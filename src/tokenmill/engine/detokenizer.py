"""Incremental detokenization that never emits a broken UTF-8 character, with stop strings."""
from __future__ import annotations

from tokenmill.engine.tokenizer import InvalidPrefix, Tokenizer

# prompt tokens kept as left context, so a token's leading space decodes as it would in the text
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Decodes a growing token list. Text is released only once it stops changing: a trailing
    U+FFFD means a multi-byte character is still split across tokens. With stop strings, the last
    `max(len(stop)) - 1` characters are held back until they can no longer begin a stop string. Stop
    strings are looked for from the token after the first `min_tokens` on (vLLM's rule: a stop string
    ends the output where a stop token could), each time only where it ends in the text a token adds
    (so one that lay wholly in the first `min_tokens` tokens' text never counts); of several found, the
    one that begins first ends the text (the longest where two begin together), so that no stop string
    is left in it."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        # the Rust tokenizer's incremental decoder where it applies: it keeps the window below itself, and
        # `ids` holds only the tokens of the last released text and those after it (for the final flush)
        self.stream = tokenizer.decode_stream(context, skip_special_tokens)
        if self.stream is None and tokenizer.decode(context, skip_special_tokens).endswith("\ufffd"):
            # a context that ends inside a character is dropped, as the stream drops it: its bytes would
            # join the first output tokens' (their own character lost, or a byte-fallback run's all U+FFFD)
            context = []
        self.ids = [] if self.stream is not None else context
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""                      # all text decoded so far (possibly past a stop string)
        self.released = ""                  # with stop strings: the text but its last `hold` characters
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.stopped_at: int | None = None  # length of the final text once a stop string matched
        self.unchecked = min_tokens + 1       # tokens still to add before stop strings count

    def add(self, token_id: int) -> str | None:
        """Adds one token; returns the stop string if the text now contains one."""
        self.ids.append(token_id)
        self.unchecked -= 1
        if self.stream is not None:
            try:
                new = self.tokenizer.stream_step(self.stream, token_id)
            except InvalidPrefix:
                # the released text stands; a fresh stream decodes the tokens after it on their own
                self.stream = self.tokenizer.decode_stream([], self.skip_special)
                for t in self.ids[self.read_offset:]:
                    new = self.tokenizer.stream_step(self.stream, t)
            if not new:
                return None
            del self.ids[:self.read_offset]
            self.read_offset = len(self.ids)
        else:
            prefix, full = self._window()
            if full.endswith("\ufffd") or len(full) <= len(prefix):
                return None
            new = self._after_released(prefix, full)
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        old_len = len(self.text)
        # grown in place: CPython resizes a string that nothing else refers to (the local alone, the
        # frontend drops the output's reference before each token), where `self.text += new` copies all
        # of it, O(length) a token
        text, self.text = self.text, ""
        text += new
        self.text = text
        if self.hold:
            end = max(0, len(text) - self.hold)
            if end > len(self.released):
                released, self.released = self.released, ""
                released += text[len(released):end]
                self.released = released
        return self._find_stop(old_len)

    def finish(self) -> str | None:
        """Ends the text where the output ended by length or end of sequence: what was held back inside a
        split character joins it (as `output_text(True)` shows it) and is looked through for stop strings as
        `add` looks; returns the stop string found, which then ends the text."""
        if self.stopped_at is not None:
            return None
        pending = self._pending_text()
        if not pending:
            return None
        old_len = len(self.text)
        self.text += pending
        self.read_offset = len(self.ids)          # nothing pending any more
        return self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> str | None:
        """Of the stop strings that end past `old_len`, the text's length before its newest part (one that
        ended before was found then, or lay in the first `min_tokens` tokens' text and does not count), the
        one that begins first (the longest of those that begin together), which then ends the text; None
        if none, or while the first `min_tokens` count."""
        if self.unchecked > 0:
            return None
        found = None
        for s in self.stop:
            pos = self.text.find(s, max(0, old_len - len(s) + 1))
            if pos != -1 and (found is None or (pos, -len(s)) < (found[0], -len(found[1]))):
                found = (pos, s)
        if found is None:
            return None
        pos, s = found
        self.stopped_at = pos + len(s) if self.include_stop else pos
        return s

    def _pending_text(self) -> str:
        """The text of tokens added since the last release: bytes that do not (yet) form a character
        decode to U+FFFD, as a Hugging Face decode of the whole output gives them."""
        if self.read_offset >= len(self.ids):
            return ""
        return self._after_released(*self._window())

    def _window(self) -> tuple[str, str]:
        """The window decode: the text of the tokens from `prefix_offset` to the last release, and of those
        from `prefix_offset` to the newest."""
        decode = self.tokenizer.decode
        return (decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special),
                decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special))

    def _after_released(self, prefix: str, full: str) -> str:
        """The text the tokens since the last release add (`_window`'s pair): where their bytes broke a
        byte-fallback run (see `InvalidPrefix`), the released text stands and they decode on their own."""
        if full.startswith(prefix):
            return full[len(prefix):]
        return self.tokenizer.decode(self.ids[self.read_offset:], skip_special_tokens=self.skip_special)

    def output_text(self, finished: bool) -> str:
        if self.stopped_at is not None:
            return self.text[:self.stopped_at]
        if finished:
            return self.text + self._pending_text()
        return self.released if self.hold else self.text
