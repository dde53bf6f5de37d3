"""Starting the engine-core process, and what a frontend needs to be one of its clients.

The core serves one duplex pipe per client (core_proc.py). `EngineCore` starts it with `num_clients`
pipes and waits for its announcement (`CoreReady`) on each; `AsyncLLM` starts one with a single pipe, and
`tokenmill serve --api-server-count N` starts one with N, hands each API server process a pipe as it
starts and, once the core has announced itself, the announcement (the API server's `CoreClient`).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from tokenmill.engine.core_messages import CoreFatal, CoreReady
from tokenmill.engine.core_proc import borrows_cores, run_engine_core


class EngineStartError(RuntimeError):
    pass


@dataclass
class CoreClient:
    """What one frontend needs to use a running engine core: its pipe, the core's announcement and its
    place among the core's clients (it allocates the handles `index + count * k`). Picklable into a
    spawned process: the pipe travels as a descriptor."""
    conn: Connection
    ready: CoreReady
    index: int = 0
    count: int = 1


class EngineCore:
    """The engine-core process (or a thread, `in_process`), started and ready, serving `num_clients`
    pipes (`clients`). It stops once every client has sent `Shutdown` or closed its pipe.

    With `wait=False` the process is started and `await_ready` waits for it, so that several cores load at
    once; whatever interrupts the wait (a failed start, a timeout, Ctrl-C) kills the process: it ignores
    SIGTERM (its server drains first), so multiprocessing's exit handler, which terminates and joins it,
    would otherwise wait forever."""

    def __init__(self, config, *, num_clients: int = 1, engine_factory: str | None = None,
                 in_process: bool = False, startup_timeout: float = 600.0, wait: bool = True,
                 name: str = "engine core"):
        """`name`: what start-up errors call it (a data-parallel core's index and device)."""
        pairs = [mp.Pipe(duplex=True) for _ in range(num_clients)]
        ours, theirs = [a for a, _ in pairs], [b for _, b in pairs]
        if in_process:
            self._proc = threading.Thread(target=run_engine_core, args=(config, theirs, engine_factory, False),
                                          daemon=True, name="engine-core")
        else:
            ctx = mp.get_context("spawn")
            self._proc = ctx.Process(target=run_engine_core, args=(config, theirs, engine_factory),
                                     daemon=True, name="tokenmill-engine-core")
        with _passive_openmp(not in_process and not getattr(config, "extra", {}).get("cpu_threads")
                             and borrows_cores(os.cpu_count() or 2, num_clients)):
            self._proc.start()
        if not in_process:
            for conn in theirs:
                conn.close()
        self._ours, self._startup_timeout, self.name = ours, startup_timeout, name
        self._deadline = time.monotonic() + startup_timeout
        self.clients: list[CoreClient] = []
        if wait:
            self.await_ready()

    def await_ready(self) -> None:
        """Waits for the core's announcement on each pipe (`clients`); kills it if anything interrupts."""
        try:
            self.clients = [CoreClient(conn, self._ready(conn), i, len(self._ours))
                            for i, conn in enumerate(self._ours)]
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Kills the core and closes this side's pipes (a core started but not to be used)."""
        self.kill()
        for conn in self._ours:
            conn.close()

    def _ready(self, conn: Connection) -> CoreReady:
        if not conn.poll(max(0.0, self._deadline - time.monotonic())):
            raise EngineStartError(f"{self.name} did not start within {self._startup_timeout} s")
        try:
            msg = conn.recv()
        except EOFError:
            raise EngineStartError(f"{self.name} exited during start-up") from None
        if isinstance(msg, CoreFatal):
            raise EngineStartError(f"{self.name} failed to start:\n{msg.message}")
        assert isinstance(msg, CoreReady), msg
        return msg

    @property
    def pipes(self) -> list[Connection]:
        """This side of the core's pipes; each becomes readable once the core has announced itself on it or
        failed."""
        return self._ours

    @property
    def pid(self) -> int | None:
        return getattr(self._proc, "pid", None)

    def join(self, timeout: float) -> None:
        """Waits for the core to stop (its clients have left), killing it after `timeout`."""
        self._proc.join(timeout)
        if self._proc.is_alive():
            self.kill()

    def kill(self):
        if isinstance(self._proc, mp.process.BaseProcess) and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


@contextlib.contextmanager
def _passive_openmp(on: bool):
    """OMP_WAIT_POLICY=PASSIVE in the environment a process started inside inherits (OpenMP reads it once,
    when the process loads it), where `on`; this process's own threads have read theirs already."""
    if not on:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        del os.environ["OMP_WAIT_POLICY"]
