"""Server-sent events as a raw ASGI response, with client-disconnect detection.

While the stream runs, a watcher task waits on `receive()` for `http.disconnect`; when it comes,
the producer is cancelled and the chunk generator closed, so its `finally` aborts the engine
sequences at once (the next engine step frees their slots). Idle streams get `: ping` comments.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

import orjson
from starlette.responses import Response

log = logging.getLogger("server.sse")

_END = object()
DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
SHUTDOWN = b'data: {"error":{"message":"the server is shutting down","type":"service_unavailable",' \
           b'"param":null,"code":"shutting_down"}}\n\n'


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
                 headers: dict[str, str] | None = None) -> None:
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.metrics = metrics
        self.ping_interval = ping_interval
        self.extra_headers = headers or {}
        self.disconnected = False

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.extra_headers.items()]
        queue: asyncio.Queue = asyncio.Queue(maxsize=256)
        producer = asyncio.create_task(self._produce(queue))
        watcher = asyncio.create_task(wait_disconnect(receive))
        draining = draining_event(scope.get("app"))
        drain = asyncio.create_task(draining.wait()) if draining is not None else None
        if self.metrics is not None:
            self.metrics.streams_open += 1
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await self._pump(queue, watcher, drain, send)
        except OSError:
            self.disconnected = True
        finally:
            tasks = [t for t in (watcher, producer, drain) if t is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.metrics is not None:
                self.metrics.streams_open -= 1
                if self.disconnected:
                    self.metrics.aborted += 1

    async def _pump(self, queue: asyncio.Queue, watcher: asyncio.Task, drain: asyncio.Task | None,
                    send: Callable) -> None:
        get: asyncio.Future | None = None
        stops = {watcher} | ({drain} if drain is not None else set())
        try:
            while True:
                if get is None:
                    get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get, *stops}, timeout=self.ping_interval,
                                             return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    self.disconnected = True
                    log.info("client disconnected; aborting its generation")
                    return
                if drain is not None and drain in done:
                    log.info("server shutting down; ending the stream")
                    await send({"type": "http.response.body", "body": SHUTDOWN + DONE, "more_body": False})
                    return
                if get not in done:
                    await send({"type": "http.response.body", "body": PING, "more_body": True})
                    continue
                item, get = get.result(), None
                if item is _END:
                    break
                await send({"type": "http.response.body", "body": item, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if get is not None:
                get.cancel()

    async def _produce(self, queue: asyncio.Queue) -> None:
        try:
            async with aclosing(self.chunks) as chunks:
                async for chunk in chunks:
                    await queue.put(chunk)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the generator should not raise; say so and end cleanly
            log.exception("stream generator failed")
            await queue.put(event({"error": {"message": "internal error while streaming", "type": "server_error",
                                             "param": None, "code": "internal_error"}}))
            await queue.put(DONE)
        await queue.put(_END)
