"""`AsyncLLM`: the asyncio client of an engine core running in its own process (or a thread).

The HTTP server awaits `generate()` streams; all commands issued in one event-loop tick go to the
core as one pipe message, and each core step comes back as one `CoreUpdate`. The pipe is read
with `loop.add_reader` and written through a `PipeSender` (pipe_sender.py), so that the loop never blocks
on a full pipe.

Own process vs thread (docs/SERVER.md has the numbers): on 2 CPU cores with a tiny model the two
served the same requests per second, the step being the bottleneck. The process is the default so
that, where steps are short (GPU), the HTTP side's JSON/SSE work never holds the engine's
interpreter lock; `in_process=True` keeps the thread variant for debugging and comparison.

An `AsyncLLM` starts a core of its own (`EngineCore`), or is the client of one that another process
started (`CoreClient`: with `--api-server-count N` the server's parent starts a core with N pipes).
Each request's outputs reach its `generate()` reader through a `RequestStream` (request_stream.py).
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from multiprocessing.reduction import ForkingPickler
from typing import AsyncIterator, Callable

from tokenmill.engine.core_client import CoreClient, EngineCore, EngineStartError
from tokenmill.engine.core_messages import (AbortRequests, AddRequest, CoreFatal, CoreUpdate, Shutdown,
                                            StopSequences)
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.pipe_sender import PipeSender
from tokenmill.engine.request_stream import RequestStream
from tokenmill.engine.tokenizer import import_tokenizer_modules
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParamError


class EngineDeadError(RuntimeError):
    """The engine core process exited or crashed; no request can be served any more."""


class RequestAbortedError(RuntimeError):
    pass


class EngineBusyError(RuntimeError):
    """The engine core could not take the request now (every grammar compile thread held past its time
    limit); the same request may succeed later."""


class AsyncLLM:
    def __init__(self, config, *, engine_factory: str | None = None, in_process: bool = False,
                 startup_timeout: float = 600.0, on_output: Callable | None = None,
                 client: CoreClient | None = None, tokenizer=None, while_starting: Callable[[], None] | None = None):
        """Starts an engine core of its own, or, given `client`, uses a core another process owns (and
        only leaves it at shutdown). `tokenizer`: the model's, already loaded for another client of the same
        model (data parallel's cores share one); else loaded from where the core names it. `while_starting`:
        work of the caller's to do while a core of its own loads its model (its app's imports)."""
        self.config = config
        self.on_output = on_output        # metrics hook: (stream_state, RequestOutput, now)
        self._streams: dict[str, RequestStream] = {}
        self._pending: list = []
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats: dict = {}
        self._stats_time = 0.0
        self._stats_waiters: list[asyncio.Future] = []
        self.dead: str | None = None       # why the engine is gone, once it is
        self._dead_callbacks: list[Callable[[str], None]] = []
        self._shutdown = False

        self._core: EngineCore | None = None
        if client is None:
            self._core = EngineCore(config, engine_factory=engine_factory, in_process=in_process,
                                    startup_timeout=startup_timeout, wait=False)
            try:
                import_tokenizer_modules(config.tokenizer or config.model)
                if while_starting is not None:
                    while_starting()
            except BaseException:
                self._core.abandon()
                raise
            self._core.await_ready()
            client = self._core.clients[0]
        self._conn = client.conn
        self._sender = PipeSender(self._conn, self._send_failed, "tokenmill-commands")
        self._handles = itertools.count(client.index, client.count)
        msg = client.ready
        self._core_pid = msg.pid
        self.model_name: str = msg.model_name
        self.max_model_len: int = msg.max_model_len
        self.vocab_size: int | None = msg.vocab_size
        self.scheduling_policy: str | None = msg.scheduling_policy
        self.tokenizer = tokenizer
        if tokenizer is None and msg.tokenizer_path is not None:
            from tokenmill.engine.tokenizer import Tokenizer
            try:
                self.tokenizer = Tokenizer(msg.tokenizer_path)
            except Exception as e:
                # a start that failed: the core, up by now, is let go (left, it held the process at its exit)
                if self._core is not None:
                    self._core.abandon()
                raise EngineStartError(str(e)) from e
        self.processor = OutputProcessor(self.tokenizer)

    # ----- lifecycle -------------------------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop | None = None):
        """Start reading the core's updates on this event loop (call from inside it)."""
        self._loop = loop or asyncio.get_running_loop()
        fd = self._conn.fileno()
        self._loop.add_reader(fd, self._on_readable)
        # uvloop makes a watched descriptor non-blocking; the pipe's messages must be sent and received
        # whole (a large batch of prompts fills the socket buffer, and a half-read update would be lost)
        os.set_blocking(fd, True)

    def on_dead(self, callback: Callable[[str], None]):
        self._dead_callbacks.append(callback)

    def shutdown(self, timeout: float = 10.0):
        if self._shutdown:
            return
        self._shutdown = True
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._conn.fileno())
            except Exception:
                pass
        self._sender.send([Shutdown()])
        self._sender.close(timeout)
        if self._core is not None:
            self._core.join(timeout)
        self._conn.close()
        # readers still waiting would hear nothing more: they end with EngineDeadError, as later requests do
        self._mark_dead("the engine was shut down")

    @property
    def pid(self) -> int | None:
        """The engine core's process id (None when it runs in a thread of this process)."""
        return self._core.pid if self._core is not None else self._core_pid

    # ----- requests --------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def generate(self, request_id: str, prompt: str | list[int], params, priority: int = 0,
                       arrival_time: float | None = None, carries_tools: bool = False, stream_interval: int = 1
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output as it grows; aborts the request if abandoned. A text
        prompt is tokenized here, on the caller's thread (the server tokenizes off its event loop and
        passes token ids). `stream_interval`: yield once a sequence has that many new tokens
        (the first output and the last always); 0 yields only the first output and the last."""
        if self.dead:
            raise EngineDeadError(self.dead)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
            prompt = self.tokenizer.encode(text)
        if getattr(params, "truncate_prompt_tokens", None) is not None:
            prompt = params.truncate(list(prompt), self.max_model_len)
        if getattr(params, "bad_words", None):
            params = params.resolve_bad_words(self.tokenizer)   # the core may have no tokenizer loaded
        if stream_interval < 0:
            raise ValueError(f"stream_interval must be 0 or more, got {stream_interval}")
        arrival_time = arrival_time or time.time()
        handle = next(self._handles)
        # the output state before the stream: a prompt the detokenizer refuses (a negative token id) fails
        # here, before the cleanup below is in force, and must leave no stream holding the id
        metrics = self.processor.add(handle, request_id, prompt, params, text, arrival_time)
        stream = RequestStream(interval=stream_interval, n=getattr(params, "n", 1) or 1, metrics=metrics,
                         num_prompt_tokens=len(prompt), max_tokens=getattr(params, "max_tokens", None))
        self._streams[request_id] = stream
        self._send(AddRequest(request_id, prompt, params, priority, arrival_time, handle, carries_tools))
        finished = False
        loop = asyncio.get_running_loop()
        try:
            while True:
                await stream.wait(loop)
                if stream.error is not None:
                    finished = True
                    raise stream.error
                out = stream.output
                if out is not None:
                    finished = stream.done
                    yield out
                    if finished:
                        return
        finally:
            # an aborted request's id may already serve a new request: only this one's state goes, and the
            # core is told to abort the id only while it still names this request (`abort` has told it)
            owned = self._streams.get(request_id) is stream
            if owned:
                del self._streams[request_id]
            self.processor.forget(request_id, handle)
            if owned and not finished and not self.dead:
                self._send(AbortRequests([request_id]))
            # ended unfinished: an abort or an error in the metrics; a request the core refused before its
            # first scheduling (a ValueError, the client's 400; EngineBusyError, a 503 counted as rejected)
            # never ran, and is no request there
            refused = isinstance(stream.error, (ValueError, EngineBusyError)) and metrics.first_scheduled_time is None
            if not stream.done and not refused and self.on_output is not None:
                self.on_output(stream, None, time.time())

    def abort(self, request_id: str | list[str]):
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.processor.forget(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None and not stream.done:
                stream.error = RequestAbortedError(f"request {rid} was aborted")
                stream.wake()
        if not self.dead:
            self._send(AbortRequests(ids))

    def fail_all(self, error: BaseException) -> int:
        """Ends every request in flight with `error` (their readers raise it, which aborts them in the
        core); returns how many there were."""
        ids = [rid for rid, s in self._streams.items() if not s.done and s.error is None]
        for rid in ids:
            self._streams[rid].error = error
            self._streams[rid].wake()
        if ids and not self.dead:
            self._send(AbortRequests(ids))
        return len(ids)

    async def get_stats(self, max_age: float = 0.0, timeout: float = 2.0) -> dict:
        """The core's latest stats; asks for fresh ones when older than `max_age` seconds."""
        if self.dead or time.monotonic() - self._stats_time <= max_age:
            return dict(self._stats)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        self._send(AbortRequests([]))       # an empty command still makes the core report stats
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            pass
        return dict(self._stats)

    # ----- pipe ------------------------------------------------------------------------------
    def _send(self, cmd):
        self._pending.append(cmd)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            (self._loop or asyncio.get_running_loop()).call_soon(self._flush)

    def _flush(self):
        self._flush_scheduled = False
        cmds, self._pending = self._pending, []
        if not cmds or self.dead:
            return
        try:
            data = ForkingPickler.dumps(cmds)
        except Exception:
            data = self._dumps_each(cmds)
            if data is None:
                return
        self._sender.send_bytes(data)

    def _send_failed(self, e: Exception) -> None:
        """A write to the core failed (its pipe closed): on the loop's thread, the engine is dead."""
        why = f"engine core pipe closed: {e}"
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:            # the writer thread's call
            on_loop = False
        if on_loop or self._loop is None or self._loop.is_closed():
            self._mark_dead(why)
            return
        try:
            self._loop.call_soon_threadsafe(self._mark_dead, why)
        except RuntimeError:            # the loop closed meanwhile
            self._mark_dead(why)

    def _dumps_each(self, cmds: list):
        """The tick's commands that pickle, as one message (None if none does). A request that does not
        pickle (a value nested past the pickler's recursion limit, which the server's body check keeps
        out but the Python API does not) fails alone, with the reason; the tick's other commands go."""
        sendable = []
        for cmd in cmds:
            try:
                ForkingPickler.dumps(cmd)
            except Exception as e:
                if not isinstance(cmd, AddRequest):
                    raise
                stream = self._streams.get(cmd.request_id)
                if stream is not None:
                    stream.error = ValueError(f"the request cannot be passed to the engine core: "
                                              f"{type(e).__name__}: {e}")
                    stream.wake()
                continue
            sendable.append(cmd)
        return ForkingPickler.dumps(sendable) if sendable else None

    def _on_readable(self):
        try:
            while self._conn.poll():
                msg = self._conn.recv()
                if isinstance(msg, CoreUpdate):
                    self._apply(msg)
                elif isinstance(msg, CoreFatal):
                    self._mark_dead(f"engine core crashed:\n{msg.message}")
                    return
        except (EOFError, OSError) as e:
            self._mark_dead(f"engine core exited ({type(e).__name__})")

    def _fail(self, rid: str, error: Exception) -> None:
        self.processor.forget(rid)
        stream = self._streams.get(rid)
        if stream is not None:
            stream.error = error
            stream.wake()

    def _apply(self, update: CoreUpdate):
        now = time.time()
        for rid, message, param in update.errors:
            self._fail(rid, SamplingParamError(param, message) if param else ValueError(message))
        for rid, message in update.busy:
            self._fail(rid, EngineBusyError(message))
        if update.outputs is not None:
            outputs, stops, failed = self.processor.process(update.outputs, now)
            if stops and not self.dead:
                self._send(StopSequences(stops))
            for rid, error in failed:
                # the core runs it on (its reader, ended by an error, tells the core nothing)
                if not self.dead:
                    self._send(AbortRequests([rid]))
                if rid in self._streams:
                    self._fail(rid, error)
            streams, on_output = self._streams, self.on_output
            for out in outputs:
                stream = streams.get(out.request_id)
                if stream is None:
                    continue
                stream.output = out
                stream.done = out.finished
                if on_output is not None:
                    on_output(stream, out, now)
                if stream.due(out):
                    stream.wake()
        if update.stats is not None:
            self._stats = update.stats
            self._stats_time = time.monotonic()
            waiters, self._stats_waiters = self._stats_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def _mark_dead(self, why: str):
        if self.dead:
            return
        self.dead = why
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._conn.fileno())
            except Exception:
                pass
        for stream in self._streams.values():
            stream.error = EngineDeadError(why)
            stream.wake()
        for fut in self._stats_waiters:
            if not fut.done():
                fut.set_result(None)
        if not self._shutdown:          # a shutdown asked for is no death to report
            for cb in self._dead_callbacks:
                cb(why)
