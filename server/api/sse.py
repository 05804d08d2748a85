"""Server-sent events as a raw ASGI response, with client-disconnect detection.

The chunk generator runs in the response's own task and each chunk is sent as it comes: one
`send` per chunk, no queue, no helper task and no timer per event (the per-token cost of a stream
is what limits the server at hundreds of streams). Three idle helpers per stream:
- a watcher task waits on `receive()` for `http.disconnect`; when it comes, the streaming task is
  cancelled at its current await and the generator closed, so its `finally` aborts the engine
  sequences at once (the next engine step frees their slots);
- the app's "draining" event (server shutdown) does the same, then `shutting_down` + [DONE] is sent;
- a pinger sends `: ping` when nothing was sent for `ping_interval` seconds.

The body messages skip the middleware's send wrappers: once `http.response.start` went through
the whole chain (status and x-request-id recorded, headers added), the body goes straight to the
server's own `send` (`scope[RAW_SEND]`, put there by the app's outermost layer). The wrappers
(starlette's error and exception middleware, ours) only look at the start message; the access
log and request metrics are written when the app returns, as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

import orjson
from starlette.responses import Response

log = logging.getLogger("server.sse")

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
SHUTDOWN = b'data: {"error":{"message":"the server is shutting down","type":"service_unavailable",' \
           b'"param":null,"code":"shutting_down"}}\n\n'
INTERNAL_ERROR = b'data: {"error":{"message":"internal error while streaming","type":"server_error",' \
                 b'"param":null,"code":"internal_error"}}\n\n'


RAW_SEND = "rwkv.raw_send"
"""Scope key of the ASGI server's send (set by server.api.app.RawSendLayer)."""


def event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def draining_event(app: Any) -> asyncio.Event | None:
    """The app's "server is shutting down" event (set by server.api.app.begin_drain)."""
    state = getattr(app, "state", None)
    return getattr(state, "draining", None) if state is not None else None


async def wait_disconnect(receive: Callable) -> None:
    """Returns when the client has gone (the request body must already be read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """A starlette Response (so FastAPI passes it through) with its own ASGI __call__."""

    def __init__(self, chunks: AsyncIterator[bytes], *, metrics: Any = None, ping_interval: float = 15.0,
                 headers: dict[str, str] | None = None, direct: Callable | None = None) -> None:
        self.chunks = chunks
        self.direct = direct  # direct(send, scope) -> a DirectStream / task_stream.TaskDirect | None
        self.status_code = 200
        self.background = None
        self.metrics = metrics
        self.ping_interval = ping_interval
        self.extra_headers = headers or {}
        self.disconnected = False
        self._stop: str | None = None  # why the streaming task was cancelled: "disconnect" | "drain"
        self._live = False  # the streaming task may be cancelled (it is inside the chunk loop)
        self._sent = 0  # body messages sent (the pinger's "was anything sent lately")
        self._path = ""  # how the body was written (metrics): "loop" or "<ds.kind>_<why it left>"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.extra_headers.items()]
        me = asyncio.current_task()
        helpers: list[asyncio.Task] = []

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
        helpers.append(watcher)
        draining = draining_event(scope.get("app"))
        if draining is not None:
            drain = asyncio.create_task(draining.wait())
            drain.add_done_callback(stop("drain"))
            helpers.append(drain)
        if self.metrics is not None:
            self.metrics.streams_open += 1
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            send = scope.get(RAW_SEND) or send  # the body: no per-message middleware hops
            ds = self.direct(send, scope) if self.direct is not None else None
            if self.ping_interval and self.ping_interval > 0:
                helpers.append(asyncio.create_task(self._pinger(send, ds)))
            self._path = "loop" if ds is None else ds.kind
            end = await (self._stream(send, me) if ds is None else self._stream_direct(ds, send, me))
            if end is not None:
                await send({"type": "http.response.body", "body": end, "more_body": False})
        except OSError:
            self.disconnected = True
        finally:
            self._live = False
            for t in helpers:
                t.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            if self.metrics is not None:
                self.metrics.streams_open -= 1
                if self.disconnected:
                    self.metrics.aborted += 1
                if self._path:
                    self.metrics.count_stream(self._path)

    async def _stream(self, send: Callable, me: asyncio.Task | None) -> bytes | None:
        """Send every chunk; the last message's body (None: the client is gone)."""
        chunks = self.chunks
        end: bytes | None = b""
        self._live = self._stop is None
        try:
            if self._stop is None:
                async for chunk in chunks:
                    self._sent += 1
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except asyncio.CancelledError:
            if self._stop is None:
                raise  # not ours (server shutdown of the task): propagate
            if me is not None and hasattr(me, "uncancel"):
                me.uncancel()
        except Exception:  # noqa: BLE001 - the generator should not raise; say so and end cleanly
            log.exception("stream generator failed")
            end = INTERNAL_ERROR + DONE
        finally:
            self._live = False
            await _close(chunks)
        return self._last_body(end)

    def _last_body(self, end: bytes | None, unfinished: bool = True) -> bytes | None:
        """The final message's body once the chunks are over: `end`, unless the task was stopped
        (disconnect: None, nothing more to send; drain: the shutting_down event + [DONE] if the
        stream's own end was not sent)."""
        if self._stop == "disconnect":
            self.disconnected = True
            log.info("client disconnected; aborting its generation")
            return None
        if self._stop == "drain":
            log.info("server shutting down; ending the stream")
            return SHUTDOWN + DONE if unfinished else b""
        return end

    async def _stream_direct(self, ds: Any, send: Callable, me: asyncio.Task | None) -> bytes | None:
        """The stream written by the engine thread (server.api.direct) after the preamble; the
        last message's body (None: the client is gone)."""
        await _close(self.chunks)  # never started: the direct stream replaces it
        end: bytes | None = b""
        self._live = self._stop is None
        try:
            if self._stop is None:
                for chunk in ds.preamble:
                    self._sent += 1
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                ds.start()
                why = await ds.left
                self._path = f"{ds.kind}_{why}"
                if why == "slow":  # the client reads slowly: the rest through the loop (flow control)
                    async for chunk in ds.rest():
                        self._sent += 1
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                elif why == "failed":
                    end = INTERNAL_ERROR + DONE
                elif why == "gone":  # the socket refused a write: make sure the connection ends
                    self.disconnected = True
                    end = None
                    ds.transport.close()
        except asyncio.CancelledError:
            if self._stop is None:
                raise  # not ours (server shutdown of the task): propagate
            if me is not None and hasattr(me, "uncancel"):
                me.uncancel()
        finally:
            self._live = False
            unfinished = ds.stop()  # no engine-thread write after this line
            if self._path == ds.kind:
                self._path = f"{ds.kind}_stopped"
            ds.close()
        return self._last_body(end, unfinished)

    async def _pinger(self, send: Callable, ds: Any = None) -> None:
        def sent() -> int:  # body messages so far, by the loop and by the direct stream
            return self._sent + (ds.sent if ds is not None else 0)

        seen = -1
        while True:
            await asyncio.sleep(self.ping_interval)
            if sent() == seen and self._live and not (ds is not None and ds.ended):
                if ds is None or not ds.ping(PING):
                    await send({"type": "http.response.body", "body": PING, "more_body": True})
            seen = sent()


async def _close(chunks: Any) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # noqa: BLE001
            log.exception("closing the stream generator failed")
