"""One API server process's HTTP side: uvicorn on a given socket, draining on SIGTERM.

The first SIGTERM/SIGINT drains: new requests get 503, those in flight finish (background responses,
which no connection waits on, are failed at once: `Serving.drain`), then the process exits. A second
one stops at once: streams in flight end with an error event, other requests get a JSON 503, and the
process exits within a few seconds. A third closes every connection.

Exit status: 0 after a drain, or a stop that cut nothing; 1 when the engine core died (after /health
has answered 503 for `dead_grace_s`) or a stop cut requests, so that an orchestrator restarts the
process. Signals that arrive while the process is already exiting change neither.
"""
from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import socket
import ssl
import sys
import time
from dataclasses import dataclass

import uvicorn
import uvloop

from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.heap import freeze_startup_objects

log = logging.getLogger("tokenmill.server")


@dataclass(frozen=True)
class HTTPOptions:
    """What the HTTP side accepts from clients, and how long it waits for them."""
    max_request_body_bytes: int = 32 * 1024 * 1024
    timeout_keep_alive: float = 5.0      # an idle connection after a response is closed after this
    header_timeout: float = 10.0         # a request's headers must be complete within this
    body_timeout: float = 60.0           # and its body within this of its headers
    send_timeout: float = 60.0           # a client that reads none of its response for this long is cut
    max_header_bytes: int = 65536        # a request's line and headers together; more gets 431
    limit_concurrency: int = 4096        # connections (and requests) beyond this get 503
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    ssl_keyfile: str | None = None       # with ssl_certfile: HTTPS (TLS) instead of HTTP
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None      # the CAs that client certificates are checked against
    ssl_cert_reqs: int = ssl.CERT_NONE   # CERT_OPTIONAL / CERT_REQUIRED: ask clients for a certificate
    docs: bool = True                    # /docs, /redoc and /openapi.json
    tokenizer_info: bool = False         # GET /tokenizer_info (it shows the chat template)
    root_path: str = ""                  # the path prefix of a proxy in front (FastAPI's root_path)
    request_id_headers: bool = False     # X-Request-Id on every response

    def __post_init__(self):
        for name in ("max_request_body_bytes", "timeout_keep_alive", "header_timeout", "body_timeout",
                     "send_timeout", "max_header_bytes", "limit_concurrency"):
            if not getattr(self, name) > 0:       # nan too
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together: HTTPS needs both the key and its certificate")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"ssl_cert_reqs must be {int(ssl.CERT_NONE)} (none), {int(ssl.CERT_OPTIONAL)} "
                             f"(optional) or {int(ssl.CERT_REQUIRED)} (required), got {self.ssl_cert_reqs}")
        if not self.tls and (self.ssl_ca_certs is not None or self.ssl_cert_reqs != ssl.CERT_NONE):
            raise ValueError("ssl_ca_certs and ssl_cert_reqs need HTTPS (ssl_keyfile and ssl_certfile)")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"root_path must start with '/' and not end with one, got {self.root_path!r}")
        if self.ssl_cert_reqs != ssl.CERT_NONE and self.ssl_ca_certs is None:
            raise ValueError("checking client certificates (ssl_cert_reqs) needs the CAs to check them against "
                             "(ssl_ca_certs)")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def check_tls(self) -> None:
        """Loads the key, certificate and CAs once, so that a missing or unreadable file, or a key that is not
        the certificate's, is refused before the model loads (uvicorn would load them only to serve)."""
        if not self.tls:
            return
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        what = f"ssl_certfile {self.ssl_certfile!r} with ssl_keyfile {self.ssl_keyfile!r}"
        try:
            ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        except ssl.SSLError as e:
            raise ValueError(f"{what}: not a PEM certificate and its private key (OpenSSL: {e})") from None
        except OSError as e:
            raise ValueError(f"{what}: {e.strerror}") from None
        if self.ssl_ca_certs is not None:
            try:
                ctx.load_verify_locations(self.ssl_ca_certs)
            except ssl.SSLError as e:
                raise ValueError(f"ssl_ca_certs {self.ssl_ca_certs!r}: not PEM certificates (OpenSSL: {e})") from None
            except OSError as e:
                raise ValueError(f"ssl_ca_certs {self.ssl_ca_certs!r}: {e.strerror}") from None


class DrainingServer(uvicorn.Server):
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

    async def on_tick(self, counter: int) -> bool:
        if counter % 10 == 0:                   # once a second (uvicorn ticks every 0.1 s)
            self._reap(time.monotonic())
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown, waiting for every connection to close: meanwhile one still receiving its
        request's body, or closing with bytes its client does not read, is dropped (each held the exit
        for uvicorn's graceful timeout, 30 s)."""
        async def reap():
            while True:
                self._reap(time.monotonic(), patience=5.0, draining=True)
                await asyncio.sleep(0.5)
        task = asyncio.get_running_loop().create_task(reap())
        try:
            await super().shutdown(sockets=sockets)
        finally:
            task.cancel()

    def _reap(self, now: float, patience: float | None = None, draining: bool = False) -> None:
        for connection in list(self.server_state.connections):
            reap = getattr(connection, "reap_if_stuck", None)
            if reap is not None:
                reap(now, patience, draining)

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
        self.serving.drain()

        async def drain():
            await self.serving.wait_idle()
            self.should_exit = True
        self._loop.create_task(drain())

    def _engine_dead(self, why: str):
        log.error("engine core died: %s", why)
        self.exit_code = 1
        self._loop.call_later(self.dead_grace_s, lambda: setattr(self, "should_exit", True))


@dataclass(frozen=True)
class ServeOptions:
    """What each API server process serves with, beside its engine client and the listening socket."""
    served_model_names: tuple[str, ...] | None = None
    api_keys: tuple[str, ...] = ()           # any of them authorizes a request; none: an open server
    max_queue_len: int = 1024
    log_level: str = "info"
    dead_grace_s: float = 2.0
    log_stats: bool = True
    log_stats_interval: float = 10.0
    log_requests: bool = False
    http: HTTPOptions = HTTPOptions()
    chat: object | None = None               # a serving.ChatOptions; None: the defaults
    metrics_dir: str | None = None           # prometheus_client's multiprocess directory, when several serve
    api_servers: int = 1                     # API server processes on the socket
    sampling_defaults: tuple = ()            # (field, value) pairs: generation_config.sampling_defaults
    stream_interval: int = 1                 # a streamed request's tokens a chunk (--stream-interval)


def configure_logging(options: ServeOptions) -> None:
    from tokenmill.server import stats_log
    logging.basicConfig(level=options.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    stats_log.enable_request_logging(options.log_requests)


def announce(model_name: str, host: str, port: int, engine_pid: int | None, scheme: str = "http") -> None:
    """`engine_pid` None: the engine runs in a thread of this process (`--engine-in-process`), whose pid it is."""
    where = f"[{host}]" if ":" in host else host        # an IPv6 address is bracketed in a URL
    pid = os.getpid() if engine_pid is None else engine_pid
    print(f"tokenmill: serving {model_name} on {scheme}://{where}:{port} (engine pid {pid})", flush=True)


def import_app_modules() -> None:
    """Imports what `serve` builds the app from (FastAPI, pydantic, the routes' modules), for a process that
    has a core's start-up to wait for anyway (`AsyncLLM`'s `while_starting`, `--api-server-count`)."""
    for module in ("app", "connections", "stats_log"):
        importlib.import_module(f"tokenmill.server.{module}")


def serve(engine: AsyncLLM, sock: socket.socket, options: ServeOptions, server_class=None,
          on_serving=None) -> int:
    """Serves the app on `sock` with uvicorn until it exits; returns the exit status. `server_class`:
    a `DrainingServer` subclass (default `DrainingServer`); `on_serving` is called once the server is
    built, before it serves."""
    from tokenmill.server import stats_log
    from tokenmill.server.app import build_app
    from tokenmill.server.connections import protocol_with_limits

    http = options.http
    try:
        app = build_app(engine, served_model_names=list(options.served_model_names or []) or None,
                        api_key=options.api_keys, max_queue_len=options.max_queue_len, vocab_size=engine.vocab_size,
                        model_path=engine.config.model, max_request_body_bytes=http.max_request_body_bytes,
                        allowed_origins=list(http.allowed_origins), allowed_methods=list(http.allowed_methods),
                        allowed_headers=list(http.allowed_headers), allow_credentials=http.allow_credentials,
                        docs=http.docs, root_path=http.root_path, request_id_headers=http.request_id_headers,
                        enable_tokenizer_info_endpoint=http.tokenizer_info,
                        metrics_dir=options.metrics_dir, store_responses=options.api_servers == 1,
                        sampling_defaults=dict(options.sampling_defaults), stream_interval=options.stream_interval,
                        **({"chat": options.chat} if options.chat is not None else {}))
    except ValueError as e:        # what the model's tokenizer cannot do that the options ask
        print(f"tokenmill: {e}", file=sys.stderr, flush=True)
        return 1
    server = (server_class or DrainingServer)(
        uvicorn.Config(app, log_level=options.log_level, timeout_keep_alive=http.timeout_keep_alive,
                       http=protocol_with_limits(http.header_timeout, http.body_timeout, http.send_timeout,
                                                 http.max_header_bytes, app.state.metrics.reject),
                       limit_concurrency=http.limit_concurrency, timeout_graceful_shutdown=30, access_log=False,
                       ssl_keyfile=http.ssl_keyfile, ssl_certfile=http.ssl_certfile, ssl_ca_certs=http.ssl_ca_certs,
                       ssl_cert_reqs=http.ssl_cert_reqs),
        app.state.serving, engine, options.dead_grace_s)
    if on_serving is not None:
        on_serving()
    freeze_startup_objects()
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
