"""Waiting while the client and the server's drain are watched: a client that leaves, or a
shutdown that begins, ends the wait (used by the SSE response, the non-streaming answers and a
prefill that precedes an answer)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi import Request
from starlette.applications import Starlette
from starlette.types import Receive

from server.api.errors import ApiError


def draining_event(app: Starlette | None) -> asyncio.Event | None:
    """The app's "server is shutting down" event (set by server.api.app.begin_drain)."""
    state = getattr(app, "state", None)
    return getattr(state, "draining", None) if state is not None else None


def draining(app: Starlette | None) -> bool:
    """Whether the server has begun to shut down."""
    ev = draining_event(app)
    return ev is not None and ev.is_set()


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the request body must already be read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def done_or_gone(request: Request, done: Awaitable[Any]) -> bool:
    """Wait for `done` (a run's end) while watching the client: True once it completed (its
    exception raised), False when the client left first; ApiError 503 `shutting_down` when the
    server begins to drain meanwhile. The caller stops the run when it is not True."""
    waits: dict[str, asyncio.Future[Any]] = {
        "done": asyncio.ensure_future(done),
        "gone": asyncio.ensure_future(wait_disconnect(request.receive)),
    }
    draining = draining_event(request.app)
    if draining is not None:
        waits["drain"] = asyncio.ensure_future(draining.wait())
    try:
        await asyncio.wait(waits.values(), return_when=asyncio.FIRST_COMPLETED)
        if waits["done"].done():
            waits["done"].result()
            return True
        if waits["gone"].done():
            return False
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    finally:
        for f in waits.values():
            f.cancel()
        await asyncio.gather(*waits.values(), return_exceptions=True)
