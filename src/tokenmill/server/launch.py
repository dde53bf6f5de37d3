"""Run the server: start the engine core, serve HTTP with uvicorn, drain on SIGTERM.

Exit status: 0 after a drain (SIGTERM/SIGINT), 1 when the engine core died (after /health has
answered 503 for `dead_grace_s`), so that an orchestrator restarts the process.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import sys

import uvicorn

from tokenmill.engine.async_engine import AsyncLLM, EngineStartError

log = logging.getLogger("tokenmill.server")


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

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        self.engine.on_dead(self._engine_dead)
        await super().serve(sockets=sockets)

    def handle_exit(self, sig, frame):
        if self._draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self._draining
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

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


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_server(config, *, host: str = "127.0.0.1", port: int = 8000, served_model_names=None,
               api_key: str | None = None, max_queue_len: int = 1024, engine_factory: str | None = None,
               log_level: str = "info", dead_grace_s: float = 2.0, in_process: bool = False,
               log_stats: bool = True, log_stats_interval: float = 10.0, log_requests: bool = False) -> int:
    from tokenmill.server import stats_log
    from tokenmill.server.app import build_app

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    stats_log.enable_request_logging(log_requests)
    config.extra.setdefault("log_level", log_level)      # the engine core's process logs at this level too
    sock = bind(host, port)
    try:
        engine = AsyncLLM(config, engine_factory=engine_factory, in_process=in_process)
    except EngineStartError as e:
        sock.close()
        print(f"tokenmill: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        app = build_app(engine, served_model_names=served_model_names, api_key=api_key,
                        max_queue_len=max_queue_len, vocab_size=engine.vocab_size, model_path=config.model)
        server = _Server(uvicorn.Config(app, log_level=log_level, timeout_keep_alive=5,
                                        timeout_graceful_shutdown=30, access_log=False),
                         app.state.serving, engine, dead_grace_s)
        bound = sock.getsockname()
        print(f"tokenmill: serving {engine.model_name} on http://{host}:{bound[1]} (engine pid {engine.pid})",
              flush=True)
        asyncio.run(stats_log.serve_with_stats(server.serve(sockets=[sock]), engine, log_stats, log_stats_interval))
        return server.exit_code
    finally:
        engine.shutdown()
        sock.close()
