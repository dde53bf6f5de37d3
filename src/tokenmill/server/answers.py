"""How answers are written: JSON and Server-Sent Events bytes, and what the chat and completions answers share
(a choice's progress through a stream, usage, logprob values, timestamps)."""
from __future__ import annotations

import time

import orjson
from fastapi.responses import Response

from tokenmill.outputs import RequestOutput
from tokenmill.server.errors import APIError

_MIN_LOGPROB = -9999.0


def dumps(obj) -> bytes:
    """Compact UTF-8 JSON (no ASCII escapes, as OpenAI sends it)."""
    return orjson.dumps(obj)


def encoded(obj) -> orjson.Fragment:
    """`obj` as JSON now, which the body holding it embeds as it is: a whole answer's logprobs are millions
    of small dicts and lists, and held until the body was encoded they set off full garbage collections
    (0.3-0.7 s each for n = 128 x 200 tokens x 21 entries, holding the GIL and so the event loop) while it
    was built; encoded a choice at a time they die young."""
    return orjson.Fragment(dumps(obj))


def json_response(obj, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def _lp(x: float) -> float:
    return _MIN_LOGPROB if x != x or x < _MIN_LOGPROB else float(x)


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(event: dict) -> bytes:
    """A Responses event as Server-Sent Events name it: by its type."""
    return b"event: " + event["type"].encode() + b"\ndata: " + dumps(event) + b"\n\n"


def error_event(err: APIError, sequence_number: int) -> dict:
    """OpenAI's `error` event of a Responses stream."""
    return {"type": "error", "code": err.code, "message": err.message, "param": err.param,
            "sequence_number": sequence_number}


class ChoiceState:
    """What has been streamed of one choice so far."""
    __slots__ = ("text_len", "num_tokens", "finished", "text_offsets", "started")

    def __init__(self):
        self.text_len = 0
        self.num_tokens = 0
        self.finished = False
        self.text_offsets = None         # completions' logprobs: `completions.TextOffsets` of the text so far
        self.started = False

    def advance(self, c, with_logprobs: bool):
        """What choice `c` (a cumulative CompletionOutput) adds since the last call, as (text, token ids,
        logprob entries), or None when there is nothing to send yet (e.g. a possible stop string is
        still withheld, or the choice already finished)."""
        if self.finished:
            return None
        text = c.text[self.text_len:]
        new_ids = c.token_ids[self.num_tokens:]
        if not text and c.finish_reason is None and (not with_logprobs or not new_ids):
            return None
        new_logprobs = c.logprobs[self.num_tokens:] if c.logprobs is not None else None
        self.text_len, self.num_tokens = len(c.text), len(c.token_ids)
        self.finished = c.finish_reason is not None
        return text, new_ids, new_logprobs


def usage(outs: list[RequestOutput], reasoning_tokens: int | None = None, choices=None) -> dict:
    """OpenAI's usage; `cached_tokens` counts the prompt tokens whose KV came from the prefix cache.
    `reasoning_tokens` (where a reasoning parser counted them) goes in `completion_tokens_details`.
    `choices`: count these outputs' tokens only (default: every output of `outs`)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for c in (choices if choices is not None else
                                                 [c for o in outs for c in o.outputs]))
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    body = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def now() -> int:
    return int(time.time())
