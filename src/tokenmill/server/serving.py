"""`Serving`, the state each endpoint shares: admission and draining, and a request's prompts handed to the
engine and answered as JSON or SSE. It takes in a request's checks and SamplingParams (`request_checks.py`)
and the token texts of answers (`token_text.py`)."""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from tokenmill.config import priority_refusal
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.outputs import RequestOutput
from tokenmill.server.answers import SSE_HEADERS, dumps, error_event, json_response, sse_event
from tokenmill.server.engine_streams import (
    ClosingStream, ServerStopping, _close_all, _first_outputs, _last_outputs, _merge_streams, _with_disconnect,
    as_api_error,
)
from tokenmill.server.errors import APIError, error_body
from tokenmill.server.prompts import PromptTokenizer
from tokenmill.server.request_checks import MAX_LOGPROB_ENTRIES_IN_FLIGHT, RequestChecks, most_logprob_entries
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.stats_log import log_request
from tokenmill.server.token_text import TokenText

logger = logging.getLogger("tokenmill")


@dataclass(frozen=True)
class ChatOptions:
    """How chat requests are rendered and their outputs parsed (vLLM's flags)."""
    chat_template: str | None = None            # a Jinja template replacing the model's
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None         # a name in tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None         # a name in reasoning.REASONING_PARSERS
    # logprobs' tokens as "token_id:{id}" where a request leaves its return_tokens_as_token_ids unset
    return_tokens_as_token_ids: bool = False

    def __post_init__(self):
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.tool_call_parser is not None:
            from tokenmill.server.tool_parsers import TOOL_PARSERS
            if self.tool_call_parser not in TOOL_PARSERS:
                raise ValueError(f"unknown --tool-call-parser {self.tool_call_parser!r}; "
                                 f"known: {', '.join(sorted(TOOL_PARSERS))}")
        if self.reasoning_parser is not None:
            from tokenmill.server.reasoning import REASONING_PARSERS
            if self.reasoning_parser not in REASONING_PARSERS:
                raise ValueError(f"unknown --reasoning-parser {self.reasoning_parser!r}; "
                                 f"known: {', '.join(sorted(REASONING_PARSERS))}")


class Serving(RequestChecks, TokenText):
    """Shared front half of both endpoints: checks, tokenisation (`prompts`), submission, draining."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], max_queue_len: int,
                 vocab_size: int | None = None, chat: ChatOptions = ChatOptions(),
                 sampling_defaults: dict | None = None, stream_interval: int = 1):
        self.engine = engine
        self.stream_interval = stream_interval     # tokens a streamed chunk waits for (--stream-interval)
        self.sampling_defaults = dict(sampling_defaults or {})    # generation_config.sampling_defaults
        self.model_names = served_model_names
        self.max_queue_len = max_queue_len
        self.waiting = 0        # admitted prompts that have not produced a first output yet
        self.vocab_size = vocab_size
        # the engine's, as its core announced it (None: unknown, and a priority is left to the engine to refuse)
        self.scheduling_policy: str | None = getattr(engine, "scheduling_policy", None)
        self.draining = False
        self.in_flight = 0
        self.logprob_entries_in_flight = 0    # what the requests in flight could return (`most_logprob_entries`)
        self._idle = asyncio.Event()
        self._idle.set()
        self.prompts = PromptTokenizer(engine.tokenizer, engine.max_model_len, chat.chat_template)
        self.enable_auto_tool_choice = chat.enable_auto_tool_choice
        self.return_tokens_as_token_ids = chat.return_tokens_as_token_ids
        self.tool_parser = self.reasoning_parser = None
        self.think_tags: tuple[int, int] | None = None       # (<think>, </think>) ids, with a reasoning parser
        self.turn_markers: tuple[str, ...] = ()                # special tokens: where a chat turn starts or ends
        self.think_tags_skipped = False      # the tokenizer's decoding drops them as special tokens
        if chat.tool_call_parser is not None:
            from tokenmill.server.tool_parsers import TOOL_PARSERS
            self.tool_parser = TOOL_PARSERS[chat.tool_call_parser]
            if engine.tokenizer is not None and not self.prompts.template_reads("tools"):
                # requests' tools would never reach the model (Phi-4-mini's own template reads them from the
                # system message instead), which answers as if it had none
                logger.warning("--tool-call-parser %s is set, but the chat template does not read `tools`: the "
                               "tools of a request will not reach the model; pass --chat-template with a "
                               "template that renders them", chat.tool_call_parser)
        if chat.reasoning_parser is not None:
            from tokenmill.engine.tokenizer import think_tag_ids
            from tokenmill.server.reasoning import REASONING_PARSERS, THINK_END, THINK_START
            self.reasoning_parser = REASONING_PARSERS[chat.reasoning_parser]
            if engine.tokenizer is not None:
                self.think_tags = think_tag_ids(engine.tokenizer, "--reasoning-parser")
                self.turn_markers = tuple(t for t in engine.tokenizer.all_special_tokens
                                          if t not in (THINK_START, THINK_END))
                self.think_tags_skipped = bool(set(self.think_tags) & engine.tokenizer.skipped_special_ids)
        self.fingerprint = "fp_tokenmill"
        self.responses: ResponseStore | None = None       # set by build_app where this process stores them
        self.background = None          # with them, the background.BackgroundResponses this process runs

    # ----- admission -------------------------------------------------------------------------
    def admit(self, num_prompts: int = 1):
        """Checks that a new request (of `num_prompts` prompts) may enter. Once this returns, the caller
        must reach `run` or `submit` (a background response's), which count the prompts as waiting until their
        first outputs arrive."""
        if self.engine.dead:
            raise APIError(503, "The engine is not running.", code="engine_dead")
        if self.draining:
            raise APIError(503, "The server is shutting down.", code="shutting_down",
                           headers={"Retry-After": "5", "Connection": "close"})
        if num_prompts > self.max_queue_len:
            # it could never enter: not a 503 to retry
            raise APIError(400, f"'prompt' holds {num_prompts} prompts; this server queues at most "
                                f"{self.max_queue_len} (--max-queue-len).", "prompt")
        if self.waiting + num_prompts > self.max_queue_len:
            raise APIError(503, f"Too many waiting requests: {self.waiting} are waiting and the limit is "
                                f"{self.max_queue_len} (--max-queue-len); retry later.",
                           code="queue_full", headers={"Retry-After": "1"})
        self.waiting += num_prompts

    def _begin(self, logprob_entries: int):
        self.in_flight += 1
        self.logprob_entries_in_flight += logprob_entries
        self._idle.clear()

    def _end(self, logprob_entries: int):
        self.in_flight -= 1
        self.logprob_entries_in_flight -= logprob_entries
        if self.in_flight == 0:
            self._idle.set()

    def drain(self) -> None:
        """New requests get 503 from now on, and background responses still running are cut (failed): no
        client's connection waits on them, and the store that would keep their result goes with the process."""
        self.draining = True
        if self.background is not None:
            self.background.stop_all(APIError(503, "The server shut down before this response finished.",
                                              code="shutting_down"))

    def stop_now(self) -> int:
        """Cuts every request in flight (streams end with an error event, others get a 503);
        returns how many were cut."""
        self.drain()
        return self.engine.fail_all(ServerStopping("the server is stopping"))

    async def wait_idle(self):
        await self._idle.wait()

    # ----- running requests ------------------------------------------------------------------
    @staticmethod
    def response_id(raw: Request, req, prefix: str) -> str:
        """vLLM's response id: `prefix`, then the X-Request-Id header's id, else the body's `request_id`,
        else a new one."""
        given = raw.headers.get("x-request-id") or req.request_id
        return f"{prefix}-{given or uuid.uuid4().hex}"

    def submit(self, prompts: list[list[int]], params, priority: int, stream: bool, carries_tools: bool = False,
               prompt_in_each_choice: bool = False, request_id: str | None = None) -> Submitted:
        """Hands prompts that `admit` let in to the engine; a 503 where their logprobs would take the requests in
        flight past `MAX_LOGPROB_ENTRIES_IN_FLIGHT`. `stream`: outputs come every `stream_interval` tokens (else
        only the first and the last); the rest as `run`'s. A priority the engine's scheduling policy would refuse
        is a 400 here, before anything is answered: a background response's request is answered before the engine
        sees it, and must be refused as the same request in the foreground is."""
        refused = None if self.scheduling_policy is None else priority_refusal(priority, self.scheduling_policy)
        if refused is not None:
            self.waiting -= len(prompts)
            raise APIError(400, refused, "priority")
        entries = most_logprob_entries(prompts, params, self.engine.max_model_len, prompt_in_each_choice)[0]
        if self.logprob_entries_in_flight + entries > MAX_LOGPROB_ENTRIES_IN_FLIGHT:
            self.waiting -= len(prompts)
            raise APIError(503, f"The requests in flight could already return {self.logprob_entries_in_flight:,} "
                                f"logprob entries and this one {entries:,}; the server holds at most "
                                f"{MAX_LOGPROB_ENTRIES_IN_FLIGHT:,} at once. Retry later.", "logprobs",
                           code="logprobs_in_flight", headers={"Retry-After": "1"})
        # a client's id need not be unique: a random part keeps each prompt's engine id its own (vLLM's rule)
        base = uuid.uuid4().hex if request_id is None else f"{request_id}-{uuid.uuid4().hex[:8]}"
        # a streamed request wakes its reader every `stream_interval` tokens; one answered whole only for
        # its first output (an engine-side refusal is still a plain HTTP error) and its last
        interval = self.stream_interval if stream else 0
        gens = [log_request(self.engine.generate(f"{base}-{i}", ids, params, priority, carries_tools=carries_tools,
                                                 stream_interval=interval),
                            f"{base}-{i}", ids, params)
                for i, ids in enumerate(prompts)]
        self._begin(entries)
        return Submitted(self, gens, entries)

    async def run(self, raw: Request, prompts: list[list[int]], params, priority: int, stream: bool,
                  make_stream, make_final, event_names: bool = False, carries_tools: bool = False,
                  field_of=None, prompt_in_each_choice: bool = False, request_id: str | None = None,
                  keep_final=None) -> Response:
        """Submit every prompt, then answer with SSE (`make_stream`) or one JSON body (`make_final`, which runs
        on a thread: a body grows with n, logprobs and max_tokens, and n=128 with 20 logprobs and 200 tokens each
        held the event loop ~1 s; `keep_final`, if given, then takes the body on the loop before it is sent).
        `event_names`: the Responses API's SSE, each event named by its type and no `[DONE]`;
        `carries_tools`: the request offers tools (a boost under the priority policy); `field_of`: the
        request's field for a parameter the engine refuses (its grammar's, by the field that asked for it);
        `prompt_in_each_choice` as `check_room`'s; `request_id`: the response's id, which begins the engine's
        id (and log name) of each prompt."""
        submitted = self.submit(prompts, params, priority, stream, carries_tools, prompt_in_each_choice, request_id)
        try:
            # Wait for the first output so that engine-side rejections are still plain HTTP errors.
            first = await submitted.first(raw)
        except BaseException as e:
            await submitted.close()
            raise as_api_error(e, field_of)
        if not stream:
            try:
                finals = await submitted.last(first, raw)
            except BaseException as e:
                raise as_api_error(e, field_of)
            finally:
                await submitted.close()
            body = await asyncio.to_thread(make_final, finals)
            if keep_final is not None:
                keep_final(body)
            return json_response(body)

        async def sse() -> AsyncIterator[bytes]:
            sequence_number = 0         # the next Responses event's
            try:
                try:
                    async for chunk in make_stream(submitted.merged(first)):
                        if event_names:
                            sequence_number = chunk["sequence_number"] + 1
                            yield sse_event(chunk)
                        else:
                            yield b"data: " + dumps(chunk) + b"\n\n"
                except Exception as e:
                    # the response has begun (status 200): an error ends the stream with an error event
                    # and, for chat and completions, [DONE], never a connection cut mid-body
                    err = as_api_error(e, field_of)
                    if not isinstance(err, APIError):
                        logger.exception("a stream failed")
                        err = APIError(500, f"internal error: {type(e).__name__}")
                    if event_names:
                        # OpenAI's error event, numbered on from the stream's events as every event is
                        yield sse_event(error_event(err, sequence_number))
                    else:
                        yield b"data: " + dumps(error_body(err.status, err.message, err.param, err.code)) + b"\n\n"
                if not event_names:
                    yield b"data: [DONE]\n\n"
            finally:
                await submitted.close()

        return ClosingStream(sse(), submitted.close, media_type="text/event-stream", headers=SSE_HEADERS)


class Submitted:
    """Prompts handed to the engine (`Serving.submit`): they count in flight, with the logprob entries they could
    return, until released (`close`, which also aborts those still running), and as waiting until their first
    outputs. Neither count outlives a `Submitted` that is closed, or released without ever having been read."""

    def __init__(self, serving: Serving, gens: list, logprob_entries: int):
        self._serving, self.gens, self._entries = serving, gens, logprob_entries
        self._waiting = len(gens)
        self._released = self._aborted = False

    async def first(self, raw: Request | None = None) -> list[RequestOutput]:
        """Every prompt's first output; `raw`: the client whose leaving ends the wait (None: nobody's)."""
        try:
            return await _with_disconnect(raw, _first_outputs(self.gens))
        finally:
            self._serving.waiting -= self._waiting
            self._waiting = 0

    async def last(self, first: list[RequestOutput], raw: Request | None = None) -> list[RequestOutput]:
        """Every prompt's last output, as `first`'s."""
        return await _with_disconnect(raw, _last_outputs(self.gens, first))

    def merged(self, first: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
        return _merge_streams(self.gens, first)

    def release(self) -> None:
        """Stops counting the prompts, without closing their streams: for ones never read (the engine was
        never told of them)."""
        if not self._released:
            self._released = True
            self._serving.waiting -= self._waiting
            self._waiting = 0
            self._serving._end(self._entries)

    async def abort(self) -> None:
        """Closes the prompts' output streams, which aborts those still running in the engine (their KV blocks
        freed); they count until released."""
        if not self._aborted:
            self._aborted = True
            await _close_all(self.gens)

    async def close(self) -> None:
        await self.abort()
        self.release()

