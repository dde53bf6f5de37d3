"""The HTTP connection protocol: uvicorn's httptools protocol with a deadline for request headers.

uvicorn closes a connection that idles after a response (`timeout_keep_alive`), but not one that
never completes a request's headers: a client that connects and sends nothing, or trickles its
headers, would hold its connection (and a slot under `limit_concurrency`) forever. Here each
request's headers must be complete within `header_timeout` seconds of the connection opening or of
the request's first byte.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def protocol_with_header_timeout(header_timeout: float) -> type:
    class Protocol(_HeaderTimeoutProtocol):
        pass
    Protocol.header_timeout = header_timeout
    return Protocol


class _HeaderTimeoutProtocol(HttpToolsProtocol):
    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)
