"""Requests still sending their body when the server begins to shut down: answered 503 at once.

An ASGI layer around the app (server.cli.make_server puts it outermost and calls `drain` right
after server.api.app.begin_drain)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request, Response
from starlette.types import Message, Receive, Scope, Send


class BodyReads:
    """The ASGI layer around the app that cuts short, when the drain begins, the requests still
    waiting for more of their body: each is answered 503 `shutting_down` (as a request waiting for
    its generation is), in the API's error shape, and its connection closed. Without it a client
    that sends its body slowly, or stops sending it, holds the graceful shutdown until uvicorn's
    deadline cancels its request (a plain-text 500 and a traceback). A body received in full
    reaches its route, which decides.

    The waiting task is cancelled out of its `receive` (as a stream's watchers stop its sending:
    server/api/streaming/sse.py) and `receive` raises ShuttingDown, an HTTPException: FastAPI's
    body parsing passes those on as they are (it turns any other error into a 400)."""

    def __init__(self, app: FastAPI) -> None:
        from starlette.exceptions import HTTPException

        class ShuttingDown(HTTPException):
            def __init__(self) -> None:
                super().__init__(503, "the server is shutting down")

        self.app, self.error = app, ShuttingDown
        self.waiting: set[asyncio.Task[Any]] = set()
        self.cut: set[asyncio.Task[Any]] = set()
        self.draining = False
        app.add_exception_handler(ShuttingDown, self._answer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, self._receive(receive) if scope["type"] == "http" else receive, send)

    def _receive(self, receive: Receive) -> Receive:
        complete = False

        async def body_receive() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            me = asyncio.current_task()
            assert me is not None
            self.waiting.add(me)
            if self.draining:  # cut short only if it has to wait: a body already here passes
                asyncio.get_running_loop().call_soon(self._cut, me)
            try:
                message = await receive()
            except asyncio.CancelledError:
                if me not in self.cut:
                    raise
                if hasattr(me, "uncancel"):  # (Python 3.11+)
                    me.uncancel()
                raise self.error() from None
            finally:
                self.waiting.discard(me)
                self.cut.discard(me)
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return body_receive

    def drain(self) -> None:
        """The drain began (on the loop): cut every wait for a body short."""
        self.draining = True
        for task in list(self.waiting):
            self._cut(task)

    def _cut(self, task: asyncio.Task[Any]) -> None:
        if task in self.waiting and task not in self.cut:
            self.cut.add(task)
            task.cancel()

    @staticmethod
    async def _answer(request: Request, exc: Exception) -> Response:
        from server.api.errors import ApiError

        # Connection: close: the rest of the body is never read
        err = ApiError(503, "the server is shutting down", code="shutting_down", headers={"Connection": "close"})
        request.state.error = err.message  # the access log's reason
        return err.response()
