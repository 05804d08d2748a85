"""Read deadlines for slow clients: uvicorn's httptools protocol with a header and a body timeout.

uvicorn bounds only the idle time BETWEEN requests (its keep-alive timeout); a client that opens
a connection and sends half a request line, or the headers and never the whole body, holds the
connection (and, with a body, a request task) forever. This protocol arms one timer per request:
from the connection's start or the request's first byte until its headers are complete
(`header_timeout`), then until its body is complete (`body_timeout`). When it fires before any
response started, the client gets `408 Request Timeout` and the connection is closed; the app,
if it was already called, sees `http.disconnect`.

It also bounds the open connections (`max_connections`): a request on a connection beyond the
bound, or while that many requests are in progress, gets a 503 in the API's error shape with
`Retry-After` (uvicorn's own `limit_concurrency` counts the new connection against itself, so
it admits one fewer than asked, and answers in plain text). The probes (/health, /metrics) are
exempt: an orchestrator must see a saturated server as alive.

Hooks into uvicorn's protocol callbacks (connection_made, on_message_begin, on_headers_complete,
on_message_complete, connection_lost), which are its public subclassing points for `http=`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("server.http")

TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\nx-request-id: %b\r\ncontent-length: %d\r\n\r\n%b"
)
TIMEOUT_BODY = (
    b'{"error":{"message":"the request was not received in time","type":"invalid_request_error",'
    b'"param":null,"code":"request_timeout"}}'
)


OVERLOADED_BODY = (
    b'{"error":{"message":"the server is at its bound of open connections (--max-connections); '
    b'retry later","type":"service_unavailable","param":null,"code":"too_many_connections"}}'
)
EXEMPT_PATHS = (b"/health", b"/metrics")
_refused = {"n": 0, "logged_at": 0.0}  # refusals since the last log line (one a minute at most)


async def overloaded(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI app a request beyond the connection bound runs instead of the server's."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(OVERLOADED_BODY)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
        (b"x-request-id", uuid.uuid4().hex.encode()),  # as the middleware gives every answer it sends
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": OVERLOADED_BODY})


class TimedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with per-request read deadlines and the connection bound (set by
    `protocol_with_deadlines`)."""

    header_timeout = 30.0
    body_timeout = 30.0
    max_connections = 0  # 0: no bound

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm(self.header_timeout)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.header_timeout)

    def on_headers_complete(self) -> None:
        if self._over_bound():
            app, self.app = self.app, overloaded  # read once, by the call below, for this request
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()
        self._arm(self.body_timeout)

    def _over_bound(self) -> bool:
        """More open connections than the bound (this one counted), or that many requests in
        progress (this one not yet counted); never for the probes."""
        n = self.max_connections
        if not n or (len(self.connections) <= n and len(self.tasks) < n):
            return False
        if self.url.split(b"?", 1)[0] in EXEMPT_PATHS:
            return False
        _refused["n"] += 1
        now = time.monotonic()
        if now - _refused["logged_at"] >= 60:
            log.warning("over --max-connections (%d): %d request(s) answered 503", n, _refused["n"])
            _refused["n"], _refused["logged_at"] = 0, now
        return True

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
        rid = uuid.uuid4().hex
        log.info("%s: request not received in time; closing the connection (request id %s)", client, rid)
        if not started:
            self.transport.write(TIMEOUT_RESPONSE % (rid.encode(), len(TIMEOUT_BODY), TIMEOUT_BODY))
        self.transport.close()


def protocol_with_deadlines(
    header_timeout: float, body_timeout: float, max_connections: int = 0
) -> type[TimedHttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with these deadlines (0: none) and
    connection bound (0: none)."""
    return type(
        "HttpProtocolWithDeadlines",
        (TimedHttpToolsProtocol,),
        {
            "header_timeout": float(header_timeout),
            "body_timeout": float(body_timeout),
            "max_connections": int(max_connections),
        },
    )
