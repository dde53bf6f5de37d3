"""Reasoning parsers (`--reasoning-parser NAME`): split a thinking model's output into
`reasoning_content` and `content`.

Order in a chat response: the reasoning parser runs first, on the whole generated text; the tool parser
(`tool_parsers/`) then runs only on the `content` it returns. A `<tool_call>` written while thinking is
therefore reasoning text, never a call. Streaming chains the same way: each `content` delta of the
reasoning stream is fed to the tool-call stream.

The rule (`qwen3`; also Nanbeige4.1, whose template is Qwen3-Thinking's):
- Generation starts inside a thinking block when the rendered prompt leaves one open in its last turn
  (`last_turn`: after the last special token): its last `<think>` has no `</think>` after it.
  Qwen3-Thinking-2507 and Nanbeige4.1 end the prompt with `<think>\\n`; Qwen3 with `enable_thinking=False`
  ends it with `<think>\\n\\n</think>\\n\\n`, which is closed.
- Otherwise the output opens a block itself if it begins, after whitespace, with `<think>` (Qwen3-4B in
  thinking mode). A `<think>` at the very start is dropped in either case.
- Inside the block everything up to the first `</think>` is reasoning and the rest is content. A block
  never closed (max_tokens reached mid-thought) makes the whole output reasoning, content None.
- Without a block everything is content, and `<think>` / `</think>` later on are ordinary text.
- Reasoning is stripped of surrounding whitespace and content of leading whitespace (the `\\n\\n` after
  `</think>`, which Qwen's templates also drop when they render history); an empty part is None.

`deepseek_r1` differs in one point: generation starts inside the block unless the prompt's last turn
closed one (a template that turned thinking off), with or without a `<think>` in the prompt.

Reasoning tokens (usage's `completion_tokens_details.reasoning_tokens`, Responses'
`output_tokens_details.reasoning_tokens`) are counted on the output's token ids: those inside the block
that `extract` reads, the tags themselves not counted. Every model these parsers are for has `<think>` and
`</think>` as single tokens of its vocabulary; `engine.tokenizer.think_tag_ids` refuses a tokenizer without them.

vLLM's qwen3 parser decides from the output alone: without `</think>` its non-streamed answer is all
content while its stream has already sent the text as reasoning. Deciding from the prompt lets a stream
route every delta at once, so the streamed parts always concatenate to the non-streamed ones.
"""
from __future__ import annotations

from tokenmill.engine.tokenizer import THINK_END, THINK_START
from tokenmill.server.errors import APIError
from tokenmill.server.tool_parsers.base import partial_suffix


def last_turn(prompt: str, markers: tuple[str, ...]) -> str:
    """The rendered prompt after its last turn marker (`markers`: the tokenizer's special tokens, such as
    ChatML's `<|im_start|>`): the part where the template opens a thinking block for the reply, or a
    continued assistant message has one open. A `<think>` in an earlier turn (a user quoting the tag) then
    opens nothing."""
    cut = max((i + len(m) for m in markers if m and (i := prompt.rfind(m)) >= 0), default=0)
    return prompt[cut:]


def budget_think_tags(think_tags: tuple[int, int] | None, budget: int | None) -> tuple[int, int] | None:
    """The think tags a request's `thinking_token_budget` counts by: the server's (`think_tags`, those of its
    reasoning parser), None without a budget; a 400 naming the field on a server without a reasoning parser,
    where nothing says which tokens mark the thinking block (vLLM's budget needs a reasoning config too)."""
    if budget is None:
        return None
    if think_tags is None:
        raise APIError(400, "thinking_token_budget needs a reasoning parser to know the thinking block's tags: start "
                            "the server with --reasoning-parser (e.g. qwen3)", "thinking_token_budget")
    return think_tags


class ReasoningParser:
    """Base: `<think>`/`</think>` blocks. Subclasses choose where generation starts."""

    def starts_in_reasoning(self, prompt: str) -> bool:
        return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)

    def extract(self, text: str, prompt: str = "") -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; `prompt` is the rendered prompt text."""
        in_reasoning = self.starts_in_reasoning(prompt)
        head = text.lstrip()
        if head.startswith(THINK_START):
            text, in_reasoning = head[len(THINK_START):], True
        if not in_reasoning:
            return None, text.lstrip() or None
        reasoning, _, content = text.partition(THINK_END)
        return reasoning.strip() or None, content.lstrip() or None

    def reasoning_tokens(self, token_ids: list[int], text: str, prompt: str, tags: tuple[int, int]) -> int:
        """How many of an output's `token_ids` (whose text is `text`) lie inside the thinking block that
        `extract` reads: those before the first `</think>` token (`tags`: `think_tag_ids`) and after the
        output's own `<think>` token if it opened the block. The tags are not counted. A model writes its
        tags as those tokens; one spelled out in smaller pieces is not read as a tag here."""
        opened = text.lstrip().startswith(THINK_START)
        if not (opened or self.starts_in_reasoning(prompt)):
            return 0
        start, end = tags
        try:
            n = token_ids.index(end)
        except ValueError:
            n = len(token_ids)
        first = 0
        if opened:
            try:
                first = token_ids.index(start, 0, n) + 1
            except ValueError:
                pass
        return n - first

    def new_stream(self, prompt: str = "") -> ReasoningStream:
        return ReasoningStream(self.starts_in_reasoning(prompt))


class Qwen3ReasoningParser(ReasoningParser):
    pass


class DeepSeekR1ReasoningParser(ReasoningParser):
    def starts_in_reasoning(self, prompt: str) -> bool:
        # always, but where the prompt's last turn closed a block itself: the template turned thinking off
        # (SmolLM3's and Qwen3's `<think>\n\n</think>\n`), and the reply is all answer
        return prompt.rfind(THINK_END) <= prompt.rfind(THINK_START)


class ReasoningStream:
    """Incremental `extract`: `feed(delta)` and then `finish()` return (reasoning_delta, content_delta),
    each None when empty. Over a whole output the reasoning deltas concatenate to `extract`'s
    reasoning_content and the content deltas to its content ("" where `extract` gives None), whatever
    the chunking. Held back until decided: a possible `<think>` at the start, a possible `</think>`, and
    whitespace that stripping might remove (leading, and reasoning's trailing)."""

    def __init__(self, in_reasoning: bool):
        self._phase = "start"           # start -> reasoning -> content, or start -> content
        self._in_reasoning = in_reasoning
        self._buf = ""                  # undecided text: start prefix, or a partial `</think>`
        self._ws: list[str] = []        # reasoning's trailing whitespace, emitted if text follows
        self._reasoning_started = False
        self._content_started = False

    def feed(self, delta: str) -> tuple[str | None, str | None]:
        reasoning, content = [], []
        self._buf += delta
        if self._phase == "start":
            # leading whitespace is stripped from reasoning and content alike: dropped here, so that a long
            # run of it is looked at once
            head = self._buf = self._buf.lstrip()
            if len(head) < len(THINK_START) and THINK_START.startswith(head):
                return None, None       # still possibly `<think>` (or only whitespace)
            if head.startswith(THINK_START):
                self._buf, self._phase = head[len(THINK_START):], "reasoning"
            else:
                self._phase = "reasoning" if self._in_reasoning else "content"
        if self._phase == "reasoning":
            end = self._buf.find(THINK_END)
            if end < 0:
                keep = partial_suffix(self._buf, THINK_END)
                self._reason(self._buf[:len(self._buf) - keep], reasoning)
                self._buf = self._buf[len(self._buf) - keep:]
            else:
                self._reason(self._buf[:end], reasoning)
                self._buf, self._ws, self._phase = self._buf[end + len(THINK_END):], [], "content"
        if self._phase == "content":
            self._content(self._buf, content)
            self._buf = ""
        return "".join(reasoning) or None, "".join(content) or None

    def finish(self) -> tuple[str | None, str | None]:
        reasoning, content = [], []
        if self._phase == "start":
            self._phase = "reasoning" if self._in_reasoning else "content"
        if self._phase == "reasoning":
            self._reason(self._buf, reasoning)
        else:
            self._content(self._buf, content)
        self._buf = ""
        return "".join(reasoning) or None, "".join(content) or None

    def _reason(self, text: str, out: list[str]) -> None:
        if not self._reasoning_started:
            text = text.lstrip()
            if not text:
                return
            self._reasoning_started = True
        body = text.rstrip()
        if body:
            out.append("".join(self._ws) + body)
            self._ws = []
        if len(body) < len(text):
            self._ws.append(text[len(body):])

    def _content(self, text: str, out: list[str]) -> None:
        if not self._content_started:
            text = text.lstrip()
            if not text:
                return
            self._content_started = True
        out.append(text)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}
