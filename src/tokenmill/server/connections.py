"""The HTTP connection protocol: uvicorn's httptools protocol with deadlines for a request's headers and
body, and for a client that stops reading its response, and a limit on a request's header bytes.

uvicorn closes a connection that idles after a response (`timeout_keep_alive`), but not one that
never completes a request: a client that connects and sends nothing, trickles its headers, or sends
headers and then less body than they announce, would hold its connection (and a slot under
`limit_concurrency`) forever. Here each request's headers must be complete within `header_timeout`
seconds of the connection opening or of the request's first byte, and its body within `body_timeout`
seconds of its headers; a connection past either deadline is closed (the request, if its handler
already runs, sees the client gone). A response's writes wait while the client's buffers are full
(uvicorn's flow control); a client that reads nothing for `send_timeout` seconds while they are full
would hold its request's handler, the response it has not read and its connection for good, so its
connection is dropped then (nothing more can be sent to it), and its request with it. Flow control
pauses only past the transport's high-water mark: a connection closed with less than that still unsent,
to a client that reads nothing, would wait to flush for good, so the server's watchdog (`reap_if_stuck`,
every second) drops a closing connection whose unsent bytes have not moved for `send_timeout` seconds.

httptools keeps a request's line and headers in memory until they are complete, however long (and
uvicorn joins a long URL piece by piece): within the header deadline one connection could push ~100 MB
of one header line into the server, before any API key is checked. A request whose line and headers
pass `max_header_bytes` gets 431 and its connection is closed.

A request that cannot be parsed (400) or whose headers are too large (431) ends its connection, but the
complete requests before it on the connection (pipelined) are answered first: HTTP/1.1 answers in order,
and uvicorn wrote its 400 at once and closed, so the response to the request before was lost and its
client read the 400 as that request's answer.

A request past `limit_concurrency` (connections or requests) gets a 503 in the error shape that names the
limit, with Retry-After, as the server's other 503s (uvicorn's was plain text, 'Service Unavailable').
Connections rank by when they opened: a request is past the limit when `limit_concurrency` connections opened
before its own are still open. uvicorn counted every open connection, so a burst that opened more than the
limit got 503 on its earliest connections (on all of them when their requests came together).

A refusal written before the request's body is read (the 413 of a body over the limit, the 400, 431 and 503
above) ends its connection with a lingering close, as nginx's. A socket closed with received bytes unread
sends its client a reset, and an async client (httpx's, under the openai client) reads nothing until its
upload is sent: the reset failed the upload and the client's transport dropped the answer unread (a
ReadError every time, and the openai client sent the upload again). The write side is shut instead (the
client reads the answer, then EOF), and what the client still sends is dropped unparsed until it closes,
for at most `linger_timeout` seconds and `linger_bytes` bytes; then the connection is cut. Such a client sees
the refusal only if the rest of its upload fits the byte bound: 4 MiB failed a 40 MB upload against the
default limit of 32 MiB.
"""
from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from collections.abc import Callable

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tokenmill.server.errors import error_body


class _StopParsing(Exception):
    """Raised in a parser callback once the request is refused; uvicorn's 400 for it is not sent
    (send_400_response)."""


def protocol_with_limits(header_timeout: float, body_timeout: float, send_timeout: float,
                         max_header_bytes: int, reject: Callable[[str], None]) -> type:
    """`reject(reason)` counts a 503 refusal (ServerMetrics.reject)."""
    class Protocol(_GuardedProtocol):
        pass
    Protocol.reject = staticmethod(reject)
    Protocol.header_timeout = header_timeout
    Protocol.body_timeout = body_timeout
    Protocol.send_timeout = send_timeout
    Protocol.max_header_bytes = max_header_bytes
    return Protocol


class _GuardedProtocol(HttpToolsProtocol):
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    send_timeout: float = 60.0
    max_header_bytes: int = 65536
    _header_bytes = 0                 # received since the request's first byte, while its headers are incomplete
    _header_fields = 0                # the request's URL and header fields, as the parser hands them over
    _refused = False                  # a 400 or 431 is sent or owed: the connection reads nothing more
    _refusal: bytes | None = None     # that answer, while responses to the requests before it are still owed
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _send_timer: asyncio.TimerHandle | None = None
    _stuck: tuple[float, int] | None = None     # (since when, unsent bytes) of a closing connection not flushing
    _cycles: tuple = ()               # the requests parsed on the connection whose responses may be unfinished
    _opened = 0                       # when the connection was made (time.monotonic_ns)
    concurrency_limit: int | None = None         # limit_concurrency, checked here (uvicorn's check is turned off)
    linger_timeout: float = 2.0       # a lingering close's bounds: what a client still sends after a refusal
    linger_bytes: int = 64 << 20
    _in_message = False               # a request's first byte is parsed and its end is not: its bytes are unread
    _lingering = False                # the write side is shut; what arrives is dropped until the connection ends
    _discarded = 0                    # bytes dropped since the refusal
    _linger_timer: asyncio.TimerHandle | None = None
    reject: Callable[[str], None]     # counts a 503 refusal by its reason (protocol_with_limits)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.concurrency_limit, self.limit_concurrency = self.limit_concurrency, None

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _disarm_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        self._close()

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        self._close()

    def _on_send_timeout(self) -> None:
        self._send_timer = None
        self._abort()

    def _abort(self) -> None:
        """Drops the connection at once (close() would wait to flush what the client does not read); its
        request's later writes are then skipped, as for a client gone, instead of raising in the handler."""
        if self.cycle is not None:
            self.cycle.disconnected = True
        self.transport.abort()

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout, self._on_send_timeout)

    def resume_writing(self) -> None:
        self._disarm_send_timer()
        super().resume_writing()

    def connection_made(self, transport) -> None:
        self._opened = time.monotonic_ns()
        super().connection_made(transport)
        self._cycle_transport = _CycleTransport(self)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused or self._lingering:
            # never parsed: the request is answered, and the parser may be past an error
            self._discarded += len(data)
            if self._discarded > self.linger_bytes:
                self.transport.abort()
            return
        # the header timer is armed exactly while a request's headers are incomplete (from the connection's
        # start, or the request's first byte, to on_headers_complete): a header line that does not end is
        # held by the parser, unseen by the callbacks below
        if self._header_timer is not None:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._header_timer is not None and self._header_bytes > self.max_header_bytes:
            self._refuse_headers()

    def on_url(self, url: bytes) -> None:
        self._count_header(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_header(self, n: int) -> None:
        self._header_fields += n
        if self._header_fields > self.max_header_bytes:
            self._refuse_headers()
            raise _StopParsing

    def _refuse_headers(self) -> None:
        self._refuse(431, b"Request Header Fields Too Large",
                     f"The request's line and headers are over {self.max_header_bytes} bytes.")

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this handling the parser's error, which says what is wrong ("Invalid character in
        # Content-Length", "Duplicate Content-Length", "Invalid method encountered"); its `msg` says only that
        # something is
        error = sys.exc_info()[1]
        if not self._refused:
            self._refuse(400, b"Bad Request", f"The request is not valid HTTP/1.1: {error}." if error else msg)

    def _refuse(self, status: int, reason: bytes, message: str, code: str | None = None,
                headers: bytes = b"") -> None:
        """Answers the request being parsed with an error and closes the connection, reading nothing more.
        The requests complete before it are answered first: the error is written once the last of their
        responses is (`on_response_complete`). `headers`: more header lines, each ending in CRLF."""
        self._refused = True
        self._disarm_header_timer()
        self._disarm_body_timer()
        body = orjson.dumps(error_body(status, message, code=code))
        self._refusal = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s"
                         b"connection: close\r\n\r\n" % (status, reason, len(body), headers) + body)
        # the refused request's own cycle, where its headers were complete: queued, it is dropped unstarted
        refused = self.cycle if self.cycle is not None and self.cycle.more_body else None
        queued = len(self.pipeline)
        self.pipeline = deque(entry for entry in self.pipeline if entry[0] is not refused)
        owed = (len(self.pipeline) < queued or self.pipeline
                or self.cycle is not None and self.cycle is not refused and not self.cycle.response_complete)
        if not owed:
            self._write_refusal()

    def _write_refusal(self) -> None:
        self.transport.write(self._refusal)
        self._refusal = None
        self._linger()

    def _close_after_response(self) -> None:
        """A request cycle's close, after a response that ends the connection: lingers while the client may
        still be sending (a request's bytes unread, or requests queued behind it)."""
        if self._in_message or self.pipeline:
            self._linger()
        else:
            self._close()

    def _linger(self) -> None:
        """Shuts the write side once what is written has gone, and drops what arrives until the client closes
        (eof_received then closes the transport), `linger_timeout` passes or `linger_bytes` arrive. No response
        follows: requests still unanswered on the connection see their client gone."""
        if self._lingering or self.transport.is_closing():
            return
        self._lingering = True
        self._disarm_header_timer()
        self._disarm_body_timer()
        self._unset_keepalive_if_required()
        self._disconnect_cycles()
        if self.transport.can_write_eof():      # not under TLS: there the client ends on the Content-Length
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(self.linger_timeout, self._on_linger_timeout)
        self.flow.resume_reading()

    def _disconnect_cycles(self) -> None:
        """Tells every unfinished request of the connection that its client is gone. uvicorn tells only the
        last request parsed: a pipelined request before it, still running, generated to its end for no one
        and then wrote to the closed transport."""
        for cycle in self._cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()

    def _on_linger_timeout(self) -> None:
        self._linger_timer = None
        self.transport.abort()

    def on_response_complete(self) -> None:
        if self._lingering:               # the connection carries no more responses
            self.server_state.total_requests += 1
            return
        last = not self.pipeline          # else the next request queued starts now
        super().on_response_complete()
        if last and self._refusal is not None and not self.transport.is_closing():
            self._unset_keepalive_if_required()
            self._write_refusal()

    def on_message_begin(self) -> None:
        self._in_message = True
        super().on_message_begin()
        self._header_bytes = self._header_fields = 0
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        self._disarm_body_timer()
        # armed for every request; one without a body completes at once (on_message_complete)
        self._body_timer = self.loop.call_later(self.body_timeout, self._on_body_timeout)
        limit = self.concurrency_limit
        if limit is not None and self._past_the_limit(limit):
            # answered here, not by a task running the app: the refusals' tasks of a burst counted as requests
            # in flight and pushed the requests within the limit past it
            self.logger.warning("Exceeded concurrency limit.")
            self.reject("too_many_connections")
            self._refuse(503, b"Service Unavailable", f"The server is serving its limit of {limit} connections "
                         "or requests (--limit-concurrency); try again later.", "too_many_connections",
                         b"retry-after: 1\r\n")
            raise _StopParsing
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is not previous:
            self.cycle.transport = self._cycle_transport
            self._cycles = [cycle for cycle in self._cycles if not cycle.response_complete] + [self.cycle]

    def _past_the_limit(self, limit: int) -> bool:
        """Whether `limit` requests are in flight, or `limit` connections opened before this one are open."""
        if len(self.tasks) >= limit:
            return True
        return len(self.connections) > limit and sum(c._opened < self._opened for c in self.connections) >= limit

    def on_message_complete(self) -> None:
        self._in_message = False
        self._disarm_body_timer()
        super().on_message_complete()

    def reap_if_stuck(self, now: float, patience: float | None = None, draining: bool = False) -> None:
        """Drops the connection if it is closing with unsent bytes that have not moved for `send_timeout`
        (or `patience`, if shorter) seconds; while the server drains, also one whose request's body is
        still arriving (its handler cannot have reached the engine)."""
        transport = self.transport
        if draining and self._body_timer is not None:
            self._abort()
            return
        unsent = transport.get_write_buffer_size() if transport.is_closing() else 0
        if not unsent:
            self._stuck = None
        elif self._stuck is None or self._stuck[1] != unsent:
            self._stuck = (now, unsent)
        elif now - self._stuck[0] >= min(self.send_timeout, patience or self.send_timeout):
            self._abort()

    def connection_lost(self, exc) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        self._disarm_header_timer()
        self._disarm_body_timer()
        self._disarm_send_timer()
        self._disconnect_cycles()
        super().connection_lost(exc)


class _CycleTransport:
    """The connection's transport as its request cycles see it. uvicorn's cycle closes the connection after a
    response that ends it (`Connection: close`: the 413, a 500); that close goes to the protocol, which lingers
    where the request's body is unread."""
    __slots__ = ("_protocol",)

    def __init__(self, protocol: _GuardedProtocol):
        self._protocol = protocol

    def write(self, data: bytes) -> None:
        self._protocol.transport.write(data)

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._protocol.transport.is_closing()

    def close(self) -> None:
        self._protocol._close_after_response()

    def __getattr__(self, name: str):
        return getattr(self._protocol.transport, name)
