"""`PipeSender`: one side's writes to a `multiprocessing` pipe between the API server and the engine core, in
order, without ever blocking the writer on a full pipe.

Both sides write whole messages and read only between writes. Blocking writes deadlocked them once a message
each way outgrew the pipe's buffer (a batch of long prompts one way, a step's prompt logprobs the other), and
a core blocked writing to one API server whose loop stalled stopped every other server's requests. A message
is written at once where the pipe has room for it and nothing is waiting before it (a step's update, a
request: the usual case, with no thread hand-off); otherwise it waits in order for a writer thread.
"""
from __future__ import annotations

import queue
import select
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Callable

# a message this small is written at once when the pipe reads writable (a Unix socket is writable while at
# most a quarter of its send buffer, ~200 KiB, is in use: the message fits without blocking)
DIRECT_MAX_BYTES = 32 * 1024


class PipeSender:
    """Writes pickled messages to `conn` in the order given. `on_error(exc)` runs once, on the thread whose
    write failed (the caller's for a message written at once, else the writer thread's): the other side is
    gone, and later messages are dropped. `backlog` is the bytes of the messages queued or being written by
    the writer thread (none is empty: a pickle never is), so 0 means it holds none."""

    def __init__(self, conn: Connection, on_error: Callable[[Exception], None], name: str):
        self._conn = conn
        self._poll = select.poll()
        self._poll.register(conn.fileno(), select.POLLOUT)
        self._on_error = on_error
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.backlog = 0
        self.failed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        self.send_bytes(ForkingPickler.dumps(msg))

    def send_bytes(self, data: bytes) -> None:
        """Writes `data` as one message (framed as `Connection.send` frames it: the reader's `recv` unpickles),
        at once or after the messages before it."""
        if self.failed:
            return
        with self._lock:
            direct = self.backlog == 0 and len(data) <= DIRECT_MAX_BYTES and bool(self._poll.poll(0))
            if not direct:
                self.backlog += len(data)
        if not direct:
            self._queue.put(data)
            return
        try:
            self._conn.send_bytes(data)
        except (OSError, ValueError) as e:
            self._fail(e)

    def close(self, timeout: float) -> None:
        """Writes what waits (for up to `timeout` seconds), then stops the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _fail(self, e: Exception) -> None:
        if not self.failed:
            self.failed = True
            self._on_error(e)

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            if not self.failed:
                try:
                    self._conn.send_bytes(data)
                except (OSError, ValueError) as e:
                    self._fail(e)
            with self._lock:
                self.backlog -= len(data)
