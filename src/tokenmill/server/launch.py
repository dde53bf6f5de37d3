"""Run the server: start the engine core, serve HTTP with uvicorn, drain on SIGTERM.

The first SIGTERM/SIGINT drains: new requests get 503, those in flight finish, then the process
exits. A second one stops at once: streams in flight end with an error event, other requests get a
JSON 503, and the process exits within a few seconds. A third closes every connection.

Exit status: 0 after a drain, or a stop that cut nothing; 1 when the engine core died (after /health
has answered 503 for `dead_grace_s`) or a stop cut requests, so that an orchestrator restarts the
process. Signals that arrive while the process is already exiting change neither.

With `api_server_count` > 1, server/api_servers.py runs several API server processes on one socket and one
engine core, with the same signals and statuses; each of them serves through `serve` here.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys

from dataclasses import dataclass

import uvicorn
import uvloop

from tokenmill.engine.async_engine import AsyncLLM, EngineStartError

log = logging.getLogger("tokenmill.server")


@dataclass(frozen=True)
class HTTPOptions:
    """What the HTTP side accepts from clients, and how long it waits for them."""
    max_request_body_bytes: int = 32 * 1024 * 1024
    timeout_keep_alive: float = 5.0      # an idle connection after a response is closed after this
    header_timeout: float = 10.0         # a request's headers must be complete within this
    limit_concurrency: int = 4096        # connections (and requests) beyond this get 503
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self):
        for name in ("max_request_body_bytes", "timeout_keep_alive", "header_timeout", "limit_concurrency"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class _Server(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains instead of closing the listener."""

    def __init__(self, config: uvicorn.Config, serving, engine: AsyncLLM, dead_grace_s: float):
        super().__init__(config)
        self.serving = serving
        self.engine = engine
        self.dead_grace_s = dead_grace_s
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._stopping = False

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        self.engine.on_dead(self._engine_dead)
        await super().serve(sockets=sockets)

    def handle_exit(self, sig, frame):
        if self._loop is None:
            self.should_exit = True
        elif not self._draining:
            self._draining = True
            self._loop.call_soon_threadsafe(self._start_drain)
        elif not self._stopping:
            self._stopping = True
            self._loop.call_soon_threadsafe(self._stop_now)
        else:
            self.should_exit = self.force_exit = True

    def _stop_now(self):
        cut = self.serving.stop_now()
        log.warning("stopping at once: %d requests in flight are cut", cut)
        if cut:
            self.exit_code = 1

        async def finish():
            # the cut requests' handlers still write their 503s and error events
            try:
                await asyncio.wait_for(self.serving.wait_idle(), 5.0)
            except asyncio.TimeoutError:
                self.force_exit = True
            self.should_exit = True
        self._loop.create_task(finish())

    def _start_drain(self):
        log.info("draining: %d requests in flight; new requests get 503", self.serving.in_flight)
        self.serving.draining = True

        async def drain():
            await self.serving.wait_idle()
            self.should_exit = True
        self._loop.create_task(drain())

    def _engine_dead(self, why: str):
        log.error("engine core died: %s", why)
        self.exit_code = 1
        self._loop.call_later(self.dead_grace_s, lambda: setattr(self, "should_exit", True))


class PortInUse(OSError):
    pass


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(e.errno, f"port {port} on {host} is already in use (is another server running "
                                     f"there?); stop it, or choose another port with --port") from None
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@dataclass(frozen=True)
class ServeOptions:
    """What each API server process serves with, beside its engine client and the listening socket."""
    served_model_names: tuple[str, ...] | None = None
    api_key: str | None = None
    max_queue_len: int = 1024
    log_level: str = "info"
    dead_grace_s: float = 2.0
    log_stats: bool = True
    log_stats_interval: float = 10.0
    log_requests: bool = False
    http: HTTPOptions = HTTPOptions()
    chat: object | None = None               # a serving.ChatOptions; None: the defaults
    metrics_dir: str | None = None           # prometheus_client's multiprocess directory, when several serve


def configure_logging(options: ServeOptions) -> None:
    from tokenmill.server import stats_log
    logging.basicConfig(level=options.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    stats_log.enable_request_logging(options.log_requests)


def run_server(config, *, host: str = "127.0.0.1", port: int = 8000, served_model_names=None,
               api_key: str | None = None, max_queue_len: int = 1024, engine_factory: str | None = None,
               log_level: str = "info", dead_grace_s: float = 2.0, in_process: bool = False,
               log_stats: bool = True, log_stats_interval: float = 10.0, log_requests: bool = False,
               http: HTTPOptions = HTTPOptions(), chat=None, api_server_count: int = 1) -> int:
    """`api_server_count` > 1: that many API server processes share the socket and one engine core
    (server/api_servers.py); 1 serves from this process."""
    if api_server_count < 1:
        raise ValueError(f"api_server_count must be at least 1, got {api_server_count}")
    if api_server_count > 1 and in_process:
        raise ValueError("the engine loop cannot run in a thread of the server process with several API servers")
    options = ServeOptions(tuple(served_model_names) if served_model_names else None, api_key, max_queue_len,
                           log_level, dead_grace_s, log_stats, log_stats_interval, log_requests, http, chat)
    configure_logging(options)
    config.extra.setdefault("log_level", log_level)      # the engine core's process logs at this level too
    try:
        sock = bind(host, port)
    except OSError as e:
        print(f"tokenmill: {e.strerror}", file=sys.stderr, flush=True)
        return 1
    if api_server_count > 1:
        from tokenmill.server.api_servers import run_api_servers
        try:
            return run_api_servers(config, sock, host, options, api_server_count, engine_factory)
        finally:
            sock.close()
    try:
        engine = AsyncLLM(config, engine_factory=engine_factory, in_process=in_process)
    except EngineStartError as e:
        sock.close()
        print(f"tokenmill: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        return serve(engine, sock, options, _Server,
                     lambda: announce(engine.model_name, host, sock.getsockname()[1], engine.pid))
    finally:
        engine.shutdown()
        sock.close()


def announce(model_name: str, host: str, port: int, engine_pid: int | None) -> None:
    print(f"tokenmill: serving {model_name} on http://{host}:{port} (engine pid {engine_pid})", flush=True)


def serve(engine: AsyncLLM, sock: socket.socket, options: ServeOptions, server_class=None,
          on_serving=None) -> int:
    """Serves the app on `sock` with uvicorn until it exits; returns the exit status. `server_class`:
    `_Server` or a subclass; `on_serving` is called once the server is built, before it serves."""
    from tokenmill.server import stats_log
    from tokenmill.server.app import build_app
    from tokenmill.server.connections import protocol_with_header_timeout

    http = options.http
    app = build_app(engine, served_model_names=list(options.served_model_names or []) or None,
                    api_key=options.api_key, max_queue_len=options.max_queue_len, vocab_size=engine.vocab_size,
                    model_path=engine.config.model, max_request_body_bytes=http.max_request_body_bytes,
                    allowed_origins=list(http.allowed_origins), allowed_methods=list(http.allowed_methods),
                    allowed_headers=list(http.allowed_headers), allow_credentials=http.allow_credentials,
                    metrics_dir=options.metrics_dir,
                    **({"chat": options.chat} if options.chat is not None else {}))
    server = (server_class or _Server)(
        uvicorn.Config(app, log_level=options.log_level, timeout_keep_alive=http.timeout_keep_alive,
                       http=protocol_with_header_timeout(http.header_timeout),
                       limit_concurrency=http.limit_concurrency, timeout_graceful_shutdown=30, access_log=False),
        app.state.serving, engine, options.dead_grace_s)
    if on_serving is not None:
        on_serving()
    # uvicorn handles signals while it serves and restores these afterwards: a signal that comes
    # while the process exits must not kill it with a status of its own. (SIG_IGN, unlike a Python
    # handler, also holds through the interpreter's finalization.)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    # uvloop: the event loop carries every stream's tokens and SSE writes, and its loop is several
    # times cheaper per callback than asyncio's
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(stats_log.serve_with_stats(server.serve(sockets=[sock]), engine, options.log_stats,
                                              options.log_stats_interval))
    return server.exit_code
