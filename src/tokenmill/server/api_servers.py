"""`--api-server-count N`: N API server processes in front of one engine core.

One API server process (FastAPI, uvicorn, uvloop) tops out around 20-25K SSE chunks a second
(lab/sse_harness_probe.py); past that its streams' chunks bunch up and inter-token latency grows. Here the
parent process binds the socket and starts the engine core, with one pipe per API server, and at once N
API server processes (spawn), each serving the same app on the inherited listening socket and talking to
the core over its own pipe. Each new connection goes to whichever process accepts it first.

Start-up: an API server imports what it serves with (the app, and transformers for the tokenizer: seconds
of a CPU core) while the core loads its model, then waits. The parent reads the core's announcement
(`CoreReady`) and hands it to each over its control pipe: only then does an API server load the tokenizer
(from where the core names it), build the app and accept connections, so that no request reaches it
before its core client is usable (connections wait in the socket's backlog meanwhile). A core that fails
to start, an API server that dies first, or a signal, ends the start: the API servers and the core are
killed (none serves yet); the exit status is 1, or 0 after a signal.

The parent alone takes signals. Its k-th SIGTERM/SIGINT is passed to every API server over a control
pipe as "act as if you had received k" (1: drain, 2: stop at once, 3: close every connection), so a signal
sent to the whole process group still counts once. Exit status: 0 once every API server has exited 0
after a signal; 1 when one exited unasked (the others are then stopped at once) or exited 1 (it cut
requests, or the engine core died). The core stops when its last client has left. An API server whose
parent is gone (its control pipe closes) stops at once.

Metrics: the API servers share a prometheus_client multiprocess directory (engine/metrics.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait

from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.core_client import CoreClient, EngineCore, EngineStartError
from tokenmill.engine.tokenizer import import_tokenizer_modules
from tokenmill.server.http_server import (DrainingServer, ServeOptions, announce, configure_logging,
                                          import_app_modules, serve)

log = logging.getLogger("tokenmill.server")

_READY = "ready"
_STARTUP_TIMEOUT_S = 600.0   # the engine core's to load its model and announce itself
_METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
_STOP_NOW = 2          # the signal count at which an API server cuts its requests
_KILL_AFTER_S = 15.0   # an API server told to stop at once that is still alive after this is killed


class _ApiServer(DrainingServer):
    """An API server under the parent: signal counts arrive over the control pipe, not as signals."""

    def __init__(self, config, serving, engine, dead_grace_s: float, control: Connection):
        super().__init__(config, serving, engine, dead_grace_s)
        self.control = control
        self._signals = 0

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def startup(self, sockets=None):
        await super().startup(sockets)
        fd = self.control.fileno()
        self._loop.add_reader(fd, self._on_control)
        os.set_blocking(fd, True)          # uvloop made it non-blocking; messages are read whole
        self.control.send(_READY)

    def _on_control(self):
        try:
            count = self.control.recv()
        except (EOFError, OSError):
            self._loop.remove_reader(self.control.fileno())
            log.error("the parent process is gone; stopping at once")
            count = max(self._signals, _STOP_NOW)
        while self._signals < count:
            self._signals += 1
            self.handle_exit(signal.SIGTERM, None)


def _api_server(conn: Connection, index: int, count: int, sock: socket.socket, control: Connection, config,
                options: ServeOptions) -> None:
    """Process entry point of one API server: client `index` of `count` of the core on `conn`."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    configure_logging(options)
    import_app_modules()
    import_tokenizer_modules(config.tokenizer or config.model)
    try:
        ready = control.recv()             # the core's announcement, once the parent has it
    except EOFError:
        sys.exit(1)                        # the parent is gone
    engine = AsyncLLM(config, client=CoreClient(conn, ready, index, count))
    try:
        code = serve(engine, sock, options, functools.partial(_ApiServer, control=control))
    finally:
        engine.shutdown()
        sock.close()
    sys.exit(code)


@dataclasses.dataclass
class _Child:
    proc: mp.process.BaseProcess
    control: Connection
    ready: bool = False

    def tell(self, message) -> None:
        try:
            self.control.send(message)
        except OSError:
            pass                           # it is exiting; its sentinel says so


class _Signals:
    """Counts SIGTERM/SIGINT and wakes `multiprocessing.connection.wait` through a socket."""

    def __init__(self):
        self.count = 0
        self.wake, self._wake_w = socket.socketpair()
        for end in (self.wake, self._wake_w):
            end.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._wake_w.fileno())
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, sig, frame):
        self.count += 1

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self.wake.recv(4096)

    def close(self) -> None:
        # as in run_server: a signal that comes while the process exits changes nothing
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        signal.set_wakeup_fd(self._old_fd)
        self.wake.close()
        self._wake_w.close()


def run_api_servers(config, sock: socket.socket, host: str, options: ServeOptions, count: int,
                    engine_factory: str | None) -> int:
    port = sock.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="tokenmill-metrics-")
    children: list[_Child] = []
    environ = os.environ.get(_METRICS_ENV)
    signals = None
    # nothing between the core's start and the `try` that ends it: a core ignores SIGTERM, so one left behind
    # by an error here would hold the exit until multiprocessing's exit handler gave up on it
    try:
        core = EngineCore(config, num_clients=count, engine_factory=engine_factory,
                          startup_timeout=_STARTUP_TIMEOUT_S, wait=False)
    except BaseException:
        shutil.rmtree(metrics_dir, ignore_errors=True)
        raise
    try:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S       # the core's own, or just after it
        signals = _Signals()
        ctx = mp.get_context("spawn")
        # prometheus_client picks its multiprocess mode at import, from the environment
        os.environ[_METRICS_ENV] = metrics_dir
        for index, conn in enumerate(core.pipes):
            # one stats line for the whole server: the stats are the core's, the same in every process
            opts = dataclasses.replace(options, metrics_dir=metrics_dir, api_servers=count,
                                       log_stats=options.log_stats and index == 0)
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_api_server, args=(conn, index, count, sock, theirs, config, opts),
                               name=f"tokenmill-api-server-{index}", daemon=True)
            proc.start()
            theirs.close()
            children.append(_Child(proc, ours))
        sock.close()                       # the API servers hold the listening socket
        code = _await_core(core, children, signals, deadline)
        if code is not None:
            return code
        # the API server holds its end of the core's pipe; this process read only the announcement on it
        for child, client in zip(children, core.clients):
            child.tell(client.ready)
            client.conn.close()
        ready = core.clients[0].ready

        def serving():
            print(f"tokenmill: {count} API server processes (pids "
                  f"{', '.join(str(c.proc.pid) for c in children)})", flush=True)
            announce(ready.model_name, host, port, ready.pid, options.http.scheme)
        return _supervise(children, signals, serving)
    finally:
        if signals is not None:
            signals.close()
        if environ is None:
            os.environ.pop(_METRICS_ENV, None)
        else:
            os.environ[_METRICS_ENV] = environ
        for child in children:
            if child.proc.is_alive():
                child.proc.kill()
            child.proc.join(5)
            child.control.close()
        if core.clients:
            for client in core.clients:
                client.conn.close()
            core.join(10.0)
        else:                              # it never became ready
            core.abandon()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _await_core(core: EngineCore, children: list[_Child], signals: _Signals, deadline: float) -> int | None:
    """Waits for the core's announcement while the API servers start: None once the core is ready, else the
    exit status (1: the core failed to start, or an API server exited first; 0: a signal came first)."""
    alive = {c.proc.sentinel: c for c in children}
    while True:
        ready = wait([*core.pipes, *alive, signals.wake], max(0.0, deadline - time.monotonic()))
        # a pipe is readable once the core has announced itself on it, or failed; past the deadline
        # `await_ready` says that it did not start in time
        if not ready or any(r in core.pipes for r in ready):
            try:
                core.await_ready()
            except EngineStartError as e:
                print(f"tokenmill: {e}", file=sys.stderr, flush=True)
                return 1
            return None
        for r in ready:
            if r in alive:
                child = alive[r]
                child.proc.join()
                log.error("API server process %d exited with status %s before the engine core was ready",
                          child.proc.pid, child.proc.exitcode)
                return 1
        signals.drain()
        if signals.count:
            log.warning("stopping before the engine core was ready")
            return 0


def _supervise(children: list[_Child], signals: _Signals, serving) -> int:
    """Runs until every API server has exited; returns the exit status."""
    alive = {c.proc.sentinel: c for c in children}
    controls = {c.control: c for c in children}
    told = 0
    failed = False
    kill_at = None
    announced = False
    while alive:
        timeout = None if kill_at is None else max(0.0, kill_at - time.monotonic())
        for ready in wait([*alive, *controls, signals.wake], timeout):
            if ready is signals.wake:
                signals.drain()
            elif ready in controls:
                child = controls[ready]
                try:
                    if ready.recv() == _READY:
                        child.ready = True
                except (EOFError, OSError):
                    del controls[ready]    # it is exiting; its sentinel follows
            elif ready in alive:
                child = alive.pop(ready)
                child.proc.join()
                code = child.proc.exitcode
                if code != 0 or not told:
                    log.error("API server process %d exited with status %s%s", child.proc.pid, code,
                              "" if told else " unasked; stopping the others")
                    failed = True
        if not announced and all(c.ready for c in children):
            announced = True
            serving()
        want = max(signals.count, _STOP_NOW if failed else 0)
        if want > told and alive:
            told = want
            for child in alive.values():
                child.tell(told)
        if told >= _STOP_NOW and kill_at is None:
            kill_at = time.monotonic() + _KILL_AFTER_S
        if kill_at is not None and time.monotonic() >= kill_at:
            for child in alive.values():
                log.error("API server process %d did not stop; killing it", child.proc.pid)
                child.proc.kill()
            failed = True
            kill_at = time.monotonic() + 5.0
    return 1 if failed else 0
