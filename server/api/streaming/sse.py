"""Server-sent events as a raw ASGI response that sends one `StreamSource`, with client-disconnect
detection, the server's drain, and keep-alive pings.

The source's chunks are sent from the response's own task as they come: one `send` per chunk,
no queue, no helper task and no timer per event (the per-token cost of a stream is what limits
the server at hundreds of streams). Three idle helpers per stream:
- a watcher task waits on `receive()` for `http.disconnect`; when it comes before the stream's
  end, the streaming task is cancelled at its current await, the source closed and its work
  aborted at once (the next engine step frees the slots). A disconnect after the end (a client
  that hangs up once it read [DONE]) is a completed stream, not an abort; nor is leaving a
  stream that only watches a run (StreamSource.stops_work: a task's, a stored response's);
- the app's "draining" event (server shutdown) does the same, then `shutting_down` + [DONE] is sent
  (a source's own ending instead where the route gives one: `error_end`);
- a pinger sends `: ping` when nothing was sent for `ping_interval` seconds.

With `direct=True` (Settings.direct_stream) the source's notifications write the chunks straight
to the socket where the connection allows it (server.api.streaming.direct); the response sends
the headers and the preamble, then waits for direct mode to end. Removing direct writes is
deleting that module, the setting, the `direct` parameter and `_direct` below.

The body messages skip the middleware's send wrappers: once `http.response.start` went through
the whole chain (status and x-request-id recorded, headers added), the body goes straight to the
server's own `send` (`scope[RAW_SEND]`, put there by the app's outermost layer). The wrappers
only look at the start message; the access log and request metrics are written when the app
returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Literal

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from server.api.metrics import Metrics
from server.api.streaming.direct import DirectWriter
from server.api.streaming.source import DONE, INTERNAL_ERROR, PING, SHUTDOWN, StreamSource
from server.api.streaming.watch import draining_event, wait_disconnect

log = logging.getLogger("server.sse")

ErrorEnd = Callable[[Literal["shutdown", "internal"]], Awaitable[bytes]]
"""A stream's last bytes when it ends on the server's side: the server shuts down ("shutdown"),
or the source failed ("internal"). Without one: the OpenAI chat error chunk, then [DONE]."""

RAW_SEND = "rwkv.raw_send"
"""Scope key of the ASGI server's send (set by server.api.app.RawSendLayer)."""


def chat_error_end(why: Literal["shutdown", "internal"]) -> bytes:
    """The OpenAI chat streams' ending when the server ends a stream (ErrorEnd's default): the
    error chunk (`shutting_down` or `internal_error`), then [DONE]."""
    return (SHUTDOWN if why == "shutdown" else INTERNAL_ERROR) + DONE


class SSEResponse(Response):
    """A starlette Response (so FastAPI passes it through) with its own ASGI __call__."""

    def __init__(
        self,
        source: StreamSource,
        *,
        metrics: Metrics | None = None,
        ping_interval: float = 15.0,
        headers: dict[str, str] | None = None,
        direct: bool = False,
        error_end: ErrorEnd | None = None,
    ) -> None:
        """error_end: how the stream ends when the server shuts down under it or the source fails
        (the Responses API's events; default: the chat error chunk + [DONE])."""
        self.source = source
        self.error_end = error_end
        self.direct = direct
        self.status_code = 200
        self.background = None
        self.metrics = metrics
        self.ping_interval = ping_interval
        self.extra_headers = headers or {}
        self.aborted = False  # the client left before the stream's end, which stopped its work
        self._stop: str | None = None  # why the streaming task was cancelled: "disconnect" | "drain"
        self._live = False  # the streaming task may be cancelled (it is sending)
        self._sent = 0  # body messages sent by the loop (the pinger's "was anything sent lately")
        self._failed = False  # the source raised (or direct writes failed)
        self._path = ""  # how the body was written (metrics): "loop" or "<source.path>_<why it left>"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.extra_headers.items()]
        helpers = self._start_helpers(scope, receive)
        if self.metrics is not None:
            self.metrics.streams_open += 1
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            send = scope.get(RAW_SEND) or send  # the body: no per-message middleware hops
            writer = DirectWriter.attach(self.source, send, scope) if self.direct else None
            if self.ping_interval > 0:
                helpers.append(asyncio.create_task(self._pinger(send, writer)))
            if writer is None:
                self._path = "loop"
            end = await self._stream(send, writer)
            if end is not None:
                await send({"type": "http.response.body", "body": end, "more_body": False})
        except OSError:
            self.aborted = self._left()
        finally:
            self._live = False
            for t in helpers:
                t.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            self.source.close()
            self._count()

    def _start_helpers(self, scope: Scope, receive: Receive) -> list[asyncio.Task[Any]]:
        """The disconnect watcher and the drain watcher: each cancels the streaming task (only
        while it sends) and says why."""
        me = asyncio.current_task()

        def stop(reason: str) -> Callable[[Any], None]:
            def cb(fut: Any) -> None:
                if fut.cancelled() or self._stop is not None:
                    return
                self._stop = reason
                if self._live and me is not None:
                    me.cancel()

            return cb

        watcher = asyncio.create_task(wait_disconnect(receive))
        watcher.add_done_callback(stop("disconnect"))
        helpers: list[asyncio.Task[Any]] = [watcher]
        draining = draining_event(scope.get("app"))
        if draining is not None:
            drain = asyncio.create_task(draining.wait())
            drain.add_done_callback(stop("drain"))
            helpers.append(drain)
        return helpers

    def _count(self) -> None:
        if self.metrics is None:
            return
        self.metrics.streams_open -= 1
        if self.aborted:
            self.metrics.aborted += 1
        if self._path:
            self.metrics.count_stream(self._path)

    async def _stream(self, send: Send, writer: DirectWriter | None) -> bytes | None:
        """Send the preamble, then the rest: on the loop, or by the direct writer until direct
        mode ends (then what is left on the loop). The last message's body (None: the client is
        gone)."""
        end: bytes | None = b""
        self._live = self._stop is None
        try:
            if self._stop is None:
                for chunk in self.source.preamble:
                    self._sent += 1
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                rest = self.source.rest() if writer is None else None
                if writer is not None:
                    end, rest = await self._direct(writer)
                if rest is not None:
                    async with aclosing(rest) as chunks:
                        async for chunk in chunks:
                            self._sent += 1
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except asyncio.CancelledError:
            if not self._our_cancel():
                raise
        except Exception:  # a source should not raise: say so (logged) and end cleanly
            log.exception("stream source failed")
            self._failed = True
        finally:
            self._live = False
            if writer is not None:
                writer.stop()  # no write by the notifications after this line
                self._path = f"{self.source.path}_{writer.state}"
        return await self._end(end)

    async def _direct(self, writer: DirectWriter) -> tuple[bytes | None, AsyncGenerator[bytes, None] | None]:
        """Direct mode, from start to its end (server.api.streaming.direct): (the last message's
        body, the chunks left for the loop or None)."""
        writer.start()
        why = await writer.left
        if why == "slow":  # the client reads slowly: the rest through the loop (flow control)
            return b"", writer.rest()
        if why == "failed":
            self._failed = True
            return b"", None
        if why == "gone":  # the socket refused a write: make sure the connection ends
            self.aborted = self._left()
            writer.transport.close()
            return None, None
        return b"", None

    def _left(self) -> bool:
        """The client left (a write failed): whether that is an abort (the stream had not ended,
        and its leaving stops work: StreamSource.stops_work)."""
        return not self.source.ended and self.source.stops_work

    def _our_cancel(self) -> bool:
        """Whether the cancel came from our watchers (then it only ends the sending: the task
        goes on); any other (the server's) must propagate."""
        if self._stop is None:
            return False
        me = asyncio.current_task()
        if me is not None and hasattr(me, "uncancel"):  # (Python 3.11+)
            me.uncancel()
        return True

    async def _end(self, end: bytes | None) -> bytes | None:
        """The final message's body once sending stopped: `end`, unless a watcher stopped it
        before the stream's end (disconnect: None, nothing more to send; drain: the
        shutting_down ending) or the source failed (the internal_error ending)."""
        if self._stop is not None and not self.source.ended:
            if self._stop == "disconnect":
                self.aborted = self.source.stops_work
                log.info(
                    "client disconnected before the end of its stream; %s",
                    "aborting its generation" if self.aborted else "the run it watched goes on",
                )
                return None
            log.info("server shutting down; ending the stream")
            return await self._error_end("shutdown")
        return await self._error_end("internal") if self._failed else end

    async def _error_end(self, why: Literal["shutdown", "internal"]) -> bytes:
        if self.error_end is None:
            return chat_error_end(why)
        try:
            return await self.error_end(why)
        except Exception:  # (as a failed source: logged, the stream ends)
            log.exception("stream source failed to end")
            return b""

    async def _pinger(self, send: Send, writer: DirectWriter | None) -> None:
        def sent() -> int:  # body messages so far, by the loop and by the direct writes
            return self._sent + (writer.sent if writer is not None else 0)

        # a ping once nothing was sent for ping_interval (checked 4 times an interval: the first
        # ping comes within 1.25 intervals of the last message, not 2 as with one check an interval)
        seen, since = sent(), time.monotonic()
        while True:
            await asyncio.sleep(self.ping_interval / 4)
            now = time.monotonic()
            if sent() != seen:
                seen, since = sent(), now
                continue
            if now - since >= self.ping_interval and self._live and not self.source.ended:
                if writer is None or not writer.ping(PING):
                    await send({"type": "http.response.body", "body": PING, "more_body": True})
                seen, since = sent(), now
