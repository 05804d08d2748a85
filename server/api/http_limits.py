"""Read deadlines for slow clients: uvicorn's httptools protocol with a header and a body timeout.

uvicorn bounds only the idle time BETWEEN requests (its keep-alive timeout); a client that opens
a connection and sends half a request line, or the headers and never the whole body, holds the
connection (and, with a body, a request task) forever. This protocol arms one timer per request:
from the connection's start or the request's first byte until its headers are complete
(`header_timeout`), then until its body is complete (`body_timeout`). When it fires before any
response started, the client gets `408 Request Timeout` and the connection is closed; the app,
if it was already called, sees `http.disconnect`. The bound on concurrent connections is
uvicorn's own `limit_concurrency` (503 beyond it), set next to this in the CLI.

Hooks into uvicorn's protocol callbacks (connection_made, on_message_begin, on_headers_complete,
on_message_complete, connection_lost), which are its public subclassing points for `http=`.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("server.http")

TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%b"
)
TIMEOUT_BODY = (
    b'{"error":{"message":"the request was not received in time","type":"invalid_request_error",'
    b'"param":null,"code":"request_timeout"}}'
)


class TimedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with per-request read deadlines (set by `protocol_with_deadlines`)."""

    header_timeout = 30.0
    body_timeout = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm(self.header_timeout)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.header_timeout)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.body_timeout)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        if seconds > 0:
            self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        started = cycle is not None and not cycle.response_complete and cycle.response_started
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
        log.info("%s: request not received in time; closing the connection", client)
        if not started:
            self.transport.write(TIMEOUT_RESPONSE % (len(TIMEOUT_BODY), TIMEOUT_BODY))
        self.transport.close()


def protocol_with_deadlines(header_timeout: float, body_timeout: float) -> type[TimedHttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these deadlines (0: none)."""
    return type(
        "HttpProtocolWithDeadlines",
        (TimedHttpToolsProtocol,),
        {"header_timeout": float(header_timeout), "body_timeout": float(body_timeout)},
    )
