"""The engine-core loop: owns an `LLMEngine` and talks to its client over one duplex pipe.

Both directions are batched so that one engine step costs one poll of the pipe and one send:
the client sends a list of commands per event-loop tick, and the core answers each step with a
single `CoreUpdate` holding every request's progress, every rejected request and fresh stats.

Outputs cross the pipe as deltas (`OutputDelta`): the engine's outputs are cumulative, and
re-pickling whole completions every step would cost O(length^2) per request. The client
(`AsyncLLM`) rebuilds the cumulative `RequestOutput`.
"""
from __future__ import annotations

import importlib
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable

from tokenmill.outputs import RequestMetrics, RequestOutput

DEFAULT_ENGINE_FACTORY = "tokenmill.engine.engine:LLMEngine"


# Commands, client -> core (each message is a list of them).
@dataclass
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: Any
    priority: int = 0
    arrival_time: float | None = None


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


# Messages, core -> client.
@dataclass
class CoreReady:
    model_name: str
    max_model_len: int
    tokenizer: Any          # the engine's tokenizer, pickled; None if it cannot be pickled
    pid: int
    vocab_size: int | None = None


@dataclass
class OutputDelta:
    index: int
    text_start: int         # keep the client's text up to here, then append `text`
    text: str
    token_ids: list[int]
    logprobs: list | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class RequestDelta:
    request_id: str
    prompt_token_ids: list[int] | None   # only on a request's first delta
    num_cached_tokens: int
    metrics: RequestMetrics | None
    finished: bool
    outputs: list[OutputDelta]
    prompt_logprobs: list | None = None  # only on a request's first delta, when asked for


@dataclass
class CoreUpdate:
    deltas: list[RequestDelta] = field(default_factory=list)
    errors: list[tuple[str, str, str | None]] = field(default_factory=list)   # (request_id, message, param)
    stats: dict | None = None
    time: float = 0.0


@dataclass
class CoreFatal:
    message: str


def load_factory(path: str) -> Callable:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class _DeltaTracker:
    """Remembers how much of each request's output was already sent."""

    def __init__(self):
        self._sent: dict[str, list[list[int]]] = {}     # request_id -> per index [num_tokens, text_len, text]

    def forget(self, request_id: str):
        self._sent.pop(request_id, None)

    def delta(self, out: RequestOutput) -> RequestDelta:
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, [])
        deltas = []
        for o in out.outputs:
            while len(sent) <= o.index:
                sent.append([0, 0, ""])
            state = sent[o.index]
            n_tok, n_text, old_text = state
            text = o.text
            # Text is normally append-only; fall back to a full resend if a withheld tail changed.
            start = n_text if text.startswith(old_text) else 0
            new_tokens = o.token_ids[n_tok:]
            if not new_tokens and start == len(text) and o.finish_reason is None and not first:
                continue
            deltas.append(OutputDelta(
                index=o.index, text_start=start, text=text[start:], token_ids=list(new_tokens),
                logprobs=None if o.logprobs is None else list(o.logprobs[n_tok:]),
                cumulative_logprob=o.cumulative_logprob, finish_reason=o.finish_reason,
                stop_reason=o.stop_reason))
            state[0], state[1], state[2] = len(o.token_ids), len(text), text
        if out.finished:
            self.forget(out.request_id)
        return RequestDelta(
            request_id=out.request_id,
            prompt_token_ids=list(out.prompt_token_ids) if first else None,
            num_cached_tokens=out.num_cached_tokens, metrics=out.metrics,
            finished=out.finished, outputs=deltas,
            prompt_logprobs=out.prompt_logprobs if first else None)


def _vocab_size(engine) -> int | None:
    for holder in (engine, getattr(engine, "model_config", None), getattr(engine, "config", None)):
        value = getattr(holder, "vocab_size", None)
        if isinstance(value, int):
            return value
    return None


def _handle(engine, cmd, tracker: _DeltaTracker, update: CoreUpdate) -> bool:
    """Apply one command; returns False on shutdown."""
    if isinstance(cmd, AddRequest):
        try:
            engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                               priority=cmd.priority, arrival_time=cmd.arrival_time)
        except (ValueError, TypeError) as e:
            update.errors.append((cmd.request_id, str(e), getattr(e, "param", None)))
    elif isinstance(cmd, AbortRequests):
        engine.abort_request(cmd.request_ids)
        for rid in cmd.request_ids:
            tracker.forget(rid)
    elif isinstance(cmd, Shutdown):
        return False
    return True


def run_engine_core(config, conn: Connection, engine_factory: str | None = None,
                    ignore_sigint: bool = True) -> None:
    """Process entry point: build the engine, announce it, then step until told to stop."""
    if ignore_sigint:
        # The server process decides when to stop (it drains first); it tells us over the pipe.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if ignore_sigint and "OMP_NUM_THREADS" not in os.environ:
        # Leave a core to the HTTP process: oversubscribed OpenMP threads spin and made CPU steps
        # ~25x slower in our measurements (docs/SERVER.md).
        import torch
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    try:
        engine = load_factory(engine_factory or DEFAULT_ENGINE_FACTORY)(config)
        try:
            import pickle
            tokenizer = engine.tokenizer
            pickle.dumps(tokenizer)
        except Exception:
            tokenizer = None
        conn.send(CoreReady(model_name=engine.model_name, max_model_len=engine.max_model_len,
                            tokenizer=tokenizer, pid=os.getpid(), vocab_size=_vocab_size(engine)))
    except BaseException:
        conn.send(CoreFatal(traceback.format_exc()))
        raise SystemExit(1)
    try:
        _loop(engine, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return                          # the client is gone; nothing left to serve
    except BaseException:
        try:
            conn.send(CoreFatal(traceback.format_exc()))
        except Exception:
            pass
        raise SystemExit(1)


def _loop(engine, conn: Connection) -> None:
    tracker = _DeltaTracker()
    running = True
    while running:
        update = CoreUpdate()
        busy = engine.has_unfinished_requests()
        # Block while idle; while busy, only drain what has already arrived.
        received = False
        while conn.poll(0 if (busy or received) else None):
            received = True
            for cmd in conn.recv():
                if not _handle(engine, cmd, tracker, update):
                    running = False
        if not running:
            break
        outputs = engine.step() if engine.has_unfinished_requests() else []
        update.deltas = [tracker.delta(o) for o in outputs]
        if received or outputs or busy:
            update.stats = engine.get_stats()
            update.time = time.time()
            conn.send(update)
