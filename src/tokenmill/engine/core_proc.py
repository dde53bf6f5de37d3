"""The engine-core loop: owns an `LLMEngine` and talks to its client over one duplex pipe.

Both directions are batched so that one engine step costs one poll of the pipe and one send:
the client sends a list of commands per event-loop tick, and the core answers each step with a
single `CoreUpdate` holding the step's report (`StepOutputs`: new token ids as arrays), every rejected
request and fresh stats. The client (`AsyncLLM`) turns reports into text and cumulative outputs.
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

from tokenmill.engine.step_outputs import StepOutputs

DEFAULT_ENGINE_FACTORY = "tokenmill.engine.engine:LLMEngine"


# Commands, client -> core (each message is a list of them).
@dataclass
class AddRequest:
    request_id: str
    prompt: list[int]
    params: Any
    priority: int = 0
    arrival_time: float | None = None
    handle: int = 0                 # the number by which reports name the request
    carries_tools: bool = False


@dataclass
class StopSequences:
    sequences: list[tuple[str, int]]     # (request id, index): a stop string ended them in the client


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
    tokenizer_path: str | None      # where the client loads the tokenizer from; None: the model has none
    pid: int
    vocab_size: int | None = None


@dataclass
class CoreUpdate:
    outputs: StepOutputs | None = None
    errors: list[tuple[str, str, str | None]] = field(default_factory=list)   # (request_id, message, param)
    stats: dict | None = None
    time: float = 0.0


@dataclass
class CoreFatal:
    message: str


def load_factory(path: str) -> Callable:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _vocab_size(engine) -> int | None:
    for holder in (engine, getattr(engine, "model_config", None), getattr(engine, "config", None)):
        value = getattr(holder, "vocab_size", None)
        if isinstance(value, int):
            return value
    return None


def _handle(engine, cmd, update: CoreUpdate) -> bool:
    """Apply one command; returns False on shutdown."""
    if isinstance(cmd, AddRequest):
        try:
            engine.add_request(cmd.request_id, cmd.prompt, cmd.params, priority=cmd.priority,
                               arrival_time=cmd.arrival_time, handle=cmd.handle, carries_tools=cmd.carries_tools)
        except (ValueError, TypeError) as e:
            update.errors.append((cmd.request_id, str(e), getattr(e, "param", None)))
    elif isinstance(cmd, StopSequences):
        engine.stop_sequences(cmd.sequences)
    elif isinstance(cmd, AbortRequests):
        engine.abort_request(cmd.request_ids)
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
        conn.send(CoreReady(model_name=engine.model_name, max_model_len=engine.max_model_len,
                            tokenizer_path=getattr(engine, "tokenizer_path", None), pid=os.getpid(),
                            vocab_size=_vocab_size(engine)))
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
    running = True
    while running:
        update = CoreUpdate()
        busy = engine.has_unfinished_requests()
        # Block while idle; while busy, only drain what has already arrived.
        received = False
        while conn.poll(0 if (busy or received) else None):
            received = True
            for cmd in conn.recv():
                if not _handle(engine, cmd, update):
                    running = False
        if not running:
            break
        outputs = engine.step() if engine.has_unfinished_requests() else None
        update.outputs = outputs or None
        if received or outputs or busy:
            update.stats = engine.get_stats()
            update.time = time.time()
            conn.send(update)
