"""The engine-core loop: owns an `LLMEngine` and talks to its clients, one duplex pipe each.

Both directions are batched so that one engine step costs one poll of the pipes and one send per
client: a client sends a list of commands per event-loop tick, and the core answers each step with a
single `CoreUpdate` holding the client's part of the step's report (`StepOutputs`: new token ids as
arrays), its rejected requests and fresh stats. A client (`AsyncLLM`) turns reports into text and
cumulative outputs. There is one client per API server process (`--api-server-count`). Updates go through
a `PipeSender` each (pipe_sender.py): a client that stops reading stops no step; one that has left
`MAX_BACKLOG_BYTES` unread is let go (its requests aborted).
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import signal
import socket
import time
import traceback
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Callable

from tokenmill.engine.core_messages import (AbortRequests, AddRequest, CoreFatal, CoreReady, CoreUpdate, Shutdown,
                                            StopSequences)
from tokenmill.engine.heap import freeze_startup_objects
from tokenmill.engine.pipe_sender import PipeSender
from tokenmill.engine.step_outputs import StepOutputs

DEFAULT_ENGINE_FACTORY = "tokenmill.engine.engine:LLMEngine"
# updates a client has left unread past which it is let go: an API server whose loop has stopped (its
# requests' outputs, kept for it, would grow without end)
MAX_BACKLOG_BYTES = 1 << 30

logger = logging.getLogger(__name__)


def cpu_threads(cores: int, api_servers: int) -> tuple[int, int]:
    """The engine core's torch threads on the CPU: (for a step, for a step of
    `model_runner.BIG_STEP_TOKENS` or more).

    A core leaves a core to each API server process: oversubscribed OpenMP threads spin, and made CPU
    steps ~25x slower in our measurements (docs/SERVER.md); data-parallel cores are given their share
    instead (`cpu_threads` in the config's extra). A core left one thread borrows the API servers' cores
    for its big steps (prefill chunks, wide batches), where a second thread pays: its OpenMP threads must
    then sleep rather than spin while they wait (`borrows_cores`: OMP_WAIT_POLICY=PASSIVE, set by the
    process that starts it), so that a busy API server keeps its core. Steps under the threshold stay on
    one thread and wake no one."""
    threads = max(1, cores - api_servers)
    borrow = threads == 1 and cores > 1 and os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    return threads, cores if borrow else threads


def borrows_cores(cores: int, api_servers: int) -> bool:
    """Whether a core started with these numbers would run its big steps on the API servers' cores, so
    that its process needs OpenMP's passive wait (see `cpu_threads`); never where OMP_NUM_THREADS or
    OMP_WAIT_POLICY is set."""
    return (cores - api_servers <= 1 < cores and "OMP_NUM_THREADS" not in os.environ
            and "OMP_WAIT_POLICY" not in os.environ)


def load_factory(path: str) -> Callable:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _vocab_size(engine) -> int | None:
    for holder in (engine, getattr(engine, "model_config", None), getattr(engine, "config", None)):
        value = getattr(holder, "vocab_size", None)
        if isinstance(value, int):
            return value
    return None


@dataclass
class _Compile:
    """A request waiting for its grammar: the compile's future, the request, when the compile was handed to
    the pool (`queued`) and when the core's loop first saw it running (`started`)."""
    future: Future
    cmd: AddRequest
    queued: float
    started: float | None = None


class _Client:
    """One client's pipe and the requests it has in the engine, to abort them if its pipe closes.

    Of K clients, client c allocates the handles c, c + K, c + 2K, ..., so a report is split by
    `handle % K` (`StepOutputs.split`). Its request ids reach the engine prefixed with "c:" when K > 1, so
    that ids of different clients never collide. A request is forgotten here once each of its sequences
    has finished (reported by the engine, or stopped by the client) or the client aborted it."""

    def __init__(self, index: int, num_clients: int, conn: Connection, compiler: Executor | None = None):
        self.index, self.num_clients, self.conn = index, num_clients, conn
        self.prefix = f"{index}:" if num_clients > 1 else ""
        self.live: dict[int, tuple[str, int, set[int]]] = {}   # handle -> (request id, n, finished indexes)
        self.handles: dict[str, int] = {}                     # request id -> handle
        # requests whose grammar compiles on `compiler`'s threads, added to the engine once it is ready, so
        # that a grammar of many seconds (thousands of tools) stalls no other request's steps
        self.compiler = compiler
        self.compiling: dict[str, _Compile] = {}
        self.sender = PipeSender(conn, lambda e: None, f"tokenmill-updates-{index}")

    def apply(self, engine, cmd, update: CoreUpdate) -> bool:
        """Applies one command; returns False when the client leaves."""
        prefix = self.prefix
        if isinstance(cmd, AddRequest):
            if cmd.handle % self.num_clients != self.index:
                update.errors.append((cmd.request_id, f"handle {cmd.handle} is not client {self.index}'s of "
                                                      f"{self.num_clients}", None))
            elif self.compiler is None or not engine.grammar_to_compile(cmd.params):
                self._add(engine, cmd, update)
            elif (grammar := engine.cached_grammar(cmd.params)) is not None:
                self._add(engine, cmd, update, grammar)
            else:
                self.compiling[cmd.request_id] = _Compile(self.compiler.submit(engine.compile_grammar, cmd.params),
                                                          cmd, time.monotonic())
        elif isinstance(cmd, StopSequences):
            engine.stop_sequences([(prefix + rid, index) for rid, index in cmd.sequences])
            for rid, index in cmd.sequences:
                self._finished(self.handles.get(rid), index)
        elif isinstance(cmd, AbortRequests):
            engine.abort_request([prefix + rid for rid in cmd.request_ids])
            for rid in cmd.request_ids:
                handle = self.handles.pop(rid, None)
                self.live.pop(handle, None)
                compiling = self.compiling.pop(rid, None)
                if compiling is not None:
                    compiling.future.cancel()     # a compile still queued behind others never runs
        elif isinstance(cmd, Shutdown):
            return False
        return True

    def _add(self, engine, cmd: AddRequest, update: CoreUpdate, grammar: tuple | None = None) -> None:
        # only a compiled grammar is passed on: engines without grammars (a test factory's) take no such argument
        extra = {} if grammar is None else {"grammar": grammar}
        try:
            engine.add_request(self.prefix + cmd.request_id, cmd.prompt, cmd.params, priority=cmd.priority,
                               arrival_time=cmd.arrival_time, handle=cmd.handle, carries_tools=cmd.carries_tools,
                               **extra)
        except (ValueError, TypeError) as e:
            update.errors.append((cmd.request_id, str(e), getattr(e, "param", None)))
        else:
            self.live[cmd.handle] = (cmd.request_id, getattr(cmd.params, "n", 1) or 1, set())
            self.handles[cmd.request_id] = cmd.handle

    def add_compiled(self, engine, update: CoreUpdate) -> bool:
        """Adds the requests whose grammar has compiled (an invalid one is the request's error, as it
        would have been at once), and fails those whose grammar has compiled for over MAX_COMPILE_SECONDS
        (its thread runs on: a compile cannot be interrupted), and those that waited that long for a thread
        (every one held by such compiles: the request is fine, the core busy); returns whether any was."""
        from tokenmill.engine.structured_output import COMPILE_THREADS, MAX_COMPILE_SECONDS
        now = time.monotonic()
        ready, given_up = [], False
        for rid, c in list(self.compiling.items()):
            if c.future.done():
                ready.append(rid)
            elif c.future.running():
                if c.started is None:
                    c.started = now
                if now - c.started > MAX_COMPILE_SECONDS:
                    del self.compiling[rid]
                    error = engine.grammar_too_slow(c.cmd.params, now - c.started)
                    update.errors.append((rid, str(error), error.param))
                    given_up = True
            elif now - c.queued > MAX_COMPILE_SECONDS and c.future.cancel():
                del self.compiling[rid]
                waited = now - c.queued
                update.busy.append((rid, f"The request's grammar waited {waited:,.1f} s for one of the engine's "
                                         f"{COMPILE_THREADS} grammar compile threads, all busy with other grammars "
                                         f"(the limit is {MAX_COMPILE_SECONDS:g} s); retry later."))
                given_up = True
        for rid in ready:
            c = self.compiling.pop(rid)
            future, cmd = c.future, c.cmd
            error = future.exception()
            if error is None:
                self._add(engine, cmd, update, future.result())
            elif isinstance(error, (ValueError, TypeError)):
                update.errors.append((rid, str(error), getattr(error, "param", None)))
            else:
                raise error
        return bool(ready) or given_up

    def failed(self, request_id: str) -> str | None:
        """Forgets a request the engine failed (`LLMEngine.take_errors`, which names it with this client's
        prefix) and returns the client's id for it; None if it is not this client's."""
        if not request_id.startswith(self.prefix):
            return None
        rid = request_id[len(self.prefix):]
        handle = self.handles.pop(rid, None)
        if handle is None:
            return None
        del self.live[handle]
        return rid

    def reported(self, outputs: StepOutputs) -> None:
        for handle, index, *_ in outputs.finished:
            self._finished(handle, index)

    def _finished(self, handle: int | None, index: int) -> None:
        entry = self.live.get(handle)
        if entry is None:
            return
        rid, n, done = entry
        done.add(index)
        if len(done) >= n:
            del self.live[handle]
            self.handles.pop(rid, None)

    def leave(self, engine) -> None:
        """The client is gone: its requests are aborted, which frees their blocks."""
        engine.abort_request([self.prefix + rid for rid in self.handles])
        self.live.clear()
        self.handles.clear()
        for c in self.compiling.values():
            c.future.cancel()
        self.compiling.clear()
        try:        # a write blocked on a client that reads no more fails now, and its thread ends
            with socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sender.close(0)
        self.conn.close()


def run_engine_core(config, conns: Connection | list[Connection], engine_factory: str | None = None,
                    ignore_sigint: bool = True) -> None:
    """Process entry point: build the engine, announce it on every pipe, then step until every client
    has left (`Shutdown`, or its pipe closed)."""
    conns = [conns] if isinstance(conns, Connection) else list(conns)
    if ignore_sigint:
        # The server process decides when to stop (it drains first); it tells us over the pipe.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if ignore_sigint and "OMP_NUM_THREADS" not in os.environ:
        import torch
        given = getattr(config, "extra", {}).get("cpu_threads")
        threads, big_step_threads = (given, given) if given else cpu_threads(os.cpu_count() or 2, len(conns))
        torch.set_num_threads(threads)
        if big_step_threads > threads and dataclasses.is_dataclass(config):
            config = dataclasses.replace(config, extra={**config.extra, "big_step_threads": big_step_threads})
    try:
        engine = load_factory(engine_factory or DEFAULT_ENGINE_FACTORY)(config)
        ready = CoreReady(model_name=engine.model_name, max_model_len=engine.max_model_len,
                          tokenizer_path=getattr(engine, "tokenizer_path", None), pid=os.getpid(),
                          vocab_size=_vocab_size(engine),
                          scheduling_policy=getattr(getattr(engine, "config", None), "scheduling_policy", None))
    except BaseException as e:
        # a ValueError is the engine refusing its configuration: its message names the value and the limit;
        # an OSError names the file or the resource (a missing model, memory the KV cache could not map)
        fatal = CoreFatal(str(e) if isinstance(e, (ValueError, OSError)) else traceback.format_exc())
        for conn in conns:
            _send(conn, fatal)
        raise SystemExit(1)
    # engines without grammars (a test factory's) add every request at once
    compiler = None
    if hasattr(engine, "grammar_to_compile"):
        from tokenmill.engine.structured_output import compile_pool
        compiler = compile_pool()
    clients = [_Client(i, len(conns), conn, compiler) for i, conn in enumerate(conns)]
    freeze_startup_objects()
    for client in clients:
        client.sender.send(ready)
    try:
        _loop(engine, clients)
    except BaseException:
        fatal = CoreFatal(traceback.format_exc())
        for client in clients:
            client.sender.send(fatal)
        for client in clients:
            client.sender.close(5.0)
        raise SystemExit(1)
    finally:
        if compiler is not None:
            compiler.shutdown(wait=False, cancel_futures=True)


def _send(conn: Connection, msg) -> bool:
    try:
        conn.send(msg)
        return True
    except OSError:                         # the client is gone (its pipe is closed)
        return False


def _loop(engine, clients: list[_Client]) -> None:
    num_clients = len(clients)
    live = {client.conn: client for client in clients}
    # tensor-parallel workers: a worker that dies while the core idles ends it at once (the server then
    # reports engine_dead), not at the next request's collective
    workers = getattr(getattr(engine, "runner", None), "workers", None)
    exits = workers.exit_watch() if workers is not None else {}
    take_errors = getattr(engine, "take_errors", None)      # engines without it (a test factory's) fail none
    while live:
        busy = engine.has_unfinished_requests()
        compiling = any(client.compiling for client in live.values())
        # Block while idle (looking in on grammars that compile every 5 ms); while busy, only drain what
        # has already arrived.
        updates: dict[_Client, CoreUpdate] = {}
        for conn in wait([*live, *exits], 0 if busy else 0.005 if compiling else None):
            if conn in exits:
                raise workers.exited(exits[conn])
            client = live[conn]
            update = updates[client] = CoreUpdate()
            try:
                while conn.poll(0):
                    for cmd in conn.recv():
                        if not client.apply(engine, cmd, update):
                            raise EOFError
            except (EOFError, OSError):
                del live[conn]
                client.leave(engine)
        if not live:
            break
        for client in live.values():
            if client.compiling:
                update = updates.get(client) or CoreUpdate()
                if client.add_compiled(engine, update):
                    updates[client] = update
        outputs = engine.step() if engine.has_unfinished_requests() else None
        for rid, message, param in take_errors() if take_errors is not None else ():
            for client in live.values():
                if (local := client.failed(rid)) is not None:
                    updates.setdefault(client, CoreUpdate()).errors.append((local, message, param))
                    break
        parts = ([outputs] if num_clients == 1 else outputs.split(num_clients)) if outputs else None
        stats = engine.get_stats() if (updates or outputs or busy) else None
        if stats is not None and "num_waiting" in stats:
            # a request whose grammar compiles waits as much as one the scheduler holds, which counts each of
            # its n sequences
            stats["num_waiting"] += sum(getattr(c.cmd.params, "n", 1) or 1 for client in live.values()
                                        for c in client.compiling.values())
        now = time.time()
        for conn, client in list(live.items()):
            part = parts[client.index] if parts is not None else None
            if part:
                client.reported(part)
            update = updates.get(client)
            # a client with requests hears from every busy step (its stats at least); one without only when
            # it asked or has outputs (an idle API server whose loop stalls gathers no backlog)
            if update is not None or part or (busy and (client.live or client.compiling)):
                update = update or CoreUpdate()
                update.outputs, update.stats, update.time = part or None, stats, now
                client.sender.send(update)
            if client.sender.failed or client.sender.backlog > MAX_BACKLOG_BYTES:
                if not client.sender.failed:
                    logger.error("API server %d has left %d MiB of updates unread: it is let go, its requests "
                                 "aborted", client.index, client.sender.backlog >> 20)
                del live[conn]
                client.leave(engine)
