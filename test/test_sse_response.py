"""server.api.streaming.sse.SSEResponse driven as an ASGI app with a scripted source and client:
a client that hangs up right after reading [DONE] completed its stream (no abort counted, nothing
aborted), on the loop path and on the direct path; one that leaves before the end is an abort
(the source's work is aborted); the drain ends an open stream with the shutting_down event."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

import pytest

from test_sse_direct import _dechunk, _read_all

from server.api.metrics import Metrics
from server.api.streaming.source import DONE, SHUTDOWN
from server.api.streaming.sse import SSEResponse


class _Source:
    """A StreamSource with a script: the preamble, then `chunks` one per take()/rest() step;
    rest() suspends after each chunk (as a send held by flow control would)."""

    path = "direct"
    foreign_thread = False
    stops_work = True

    def __init__(self, chunks: list[bytes], on_last: Callable[[], None] = lambda: None) -> None:
        self.preamble = [b"data: {\"pre\":1}\n\n"]
        self.chunks, self.on_last = list(chunks), on_last
        self.ended = False
        self.aborted = 0
        self.closed = 0
        self.fn: Callable[[], None] | None = None

    def _next(self) -> tuple[bytes, bool]:
        out = self.chunks.pop(0)
        last = not self.chunks
        if last:
            self.ended = True
            self.on_last()  # the client reads it at once
        return out, last

    def take(self) -> tuple[bytes, bool] | None:  # everything pending: here, the rest of the script
        if not self.chunks:
            return None
        out = b""
        while self.chunks:
            data, last = self._next()
            out += data
        return out, last

    async def rest(self) -> AsyncIterator[bytes]:
        while self.chunks:
            out, _ = self._next()
            yield out
            await asyncio.sleep(0.01)

    def listen(self, fn: Callable[[], None] | None) -> None:
        self.fn = fn

    def abort(self) -> None:
        self.aborted += 1

    def close(self) -> None:
        self.closed += 1
        if not self.ended:
            self.abort()


def _client(hang_up: asyncio.Event) -> Callable:
    """receive(): http.disconnect once `hang_up` is set."""
    async def receive() -> dict:
        await hang_up.wait()
        return {"type": "http.disconnect"}
    return receive


async def _run(response: SSEResponse, receive: Callable, send: Callable, app=None) -> None:
    scope = {"type": "http", "http_version": "1.1", "app": app}
    await asyncio.wait_for(response(scope, receive, send), 5)


def _loop_sender() -> tuple[list[bytes], Callable]:
    body: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            body.append(message.get("body", b""))
    return body, send


CHUNKS = [b"data: {\"t\":1}\n\n", b"data: {\"t\":2}\n\n" + DONE]
LONGER = [b"data: {\"t\":1}\n\n", b"data: {\"t\":2}\n\n", b"data: {\"t\":3}\n\n" + DONE]


async def test_a_hang_up_after_done_on_the_loop_is_no_abort():
    hang_up, metrics = asyncio.Event(), Metrics()
    source = _Source(CHUNKS, hang_up.set)
    body, send = _loop_sender()
    await _run(SSEResponse(source, metrics=metrics), _client(hang_up), send)
    assert b"".join(body).endswith(DONE) and source.ended
    assert metrics.aborted == 0 and source.aborted == 0 and metrics.stream_paths == {"loop": 1}


@pytest.mark.parametrize("stops_work", [True, False], ids=["its-own-run", "watching"])
async def test_a_hang_up_before_the_end_is_an_abort(stops_work, caplog):
    """... of a stream whose leaving stops work; one that only watches a run (a task's stream)
    left it: no abort counted, and the log says the run goes on (QA: counted and said aborting)."""
    hang_up, metrics = asyncio.Event(), Metrics()
    source = _Source(LONGER)
    source.stops_work = stops_work
    body, send = _loop_sender()

    async def sending(message: dict) -> None:
        await send(message)
        if b"\"t\":1" in message.get("body", b""):
            hang_up.set()  # gone after the first chunk

    caplog.set_level(logging.INFO, logger="server.sse")
    await _run(SSEResponse(source, metrics=metrics), _client(hang_up), sending)
    assert not source.ended and not b"".join(body).endswith(DONE)
    assert metrics.aborted == int(stops_work) and source.aborted == 1 and metrics.streams_open == 0
    said = "aborting its generation" if stops_work else "the run it watched goes on"
    assert said in caplog.text, caplog.text


async def test_the_drain_ends_an_open_stream_with_shutting_down():
    hang_up, draining = asyncio.Event(), asyncio.Event()
    app = SimpleNamespace(state=SimpleNamespace(draining=draining))
    source = _Source(LONGER)
    body, send = _loop_sender()

    async def sending(message: dict) -> None:
        await send(message)
        if b"\"t\":1" in message.get("body", b""):
            draining.set()

    await _run(SSEResponse(source), _client(hang_up), sending, app)
    assert b"".join(body).endswith(SHUTDOWN + DONE) and source.aborted == 1


class _Cycle:
    """The shape of uvicorn's httptools RequestResponseCycle around one end of a socket pair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.chunked_encoding, self.response_complete = sock, True, False
        self.transport = self
        self.loop_sent = b""

    # the transport
    def get_extra_info(self, key: str):
        return self.sock if key == "socket" else None

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.sock.send(data)

    def close(self) -> None:
        pass

    async def send(self, message: dict) -> None:  # uvicorn's send: chunk-framed on the socket
        if message["type"] == "http.response.body":
            body = message.get("body", b"")
            self.sock.send((b"%x\r\n%b\r\n" % (len(body), body)) if body else b"0\r\n\r\n")


async def test_a_hang_up_after_done_on_the_direct_path_is_no_abort():
    """The direct writer writes [DONE] and tells the loop; the client's hang-up reaches the loop
    first (it is scheduled before the writer's news): still a completed stream."""
    a, b = socket.socketpair()
    a.setblocking(False)
    hang_up, metrics = asyncio.Event(), Metrics()
    source = _Source(CHUNKS, hang_up.set)
    cycle = _Cycle(a)
    await _run(SSEResponse(source, metrics=metrics, direct=True), _client(hang_up), cycle.send)
    got = _dechunk(_read_all(b).removesuffix(b"0\r\n\r\n"))
    assert got == b"".join(source.preamble + CHUNKS)
    assert metrics.aborted == 0 and source.aborted == 0 and metrics.stream_paths == {"direct_ended": 1}
    a.close(), b.close()


class _Slow(_Source):
    """A source whose first chunk comes `delay` seconds after its preamble."""

    path = "loop"

    def __init__(self, chunks: list[bytes], delay: float) -> None:
        super().__init__(chunks)
        self.delay = delay

    def take(self) -> None:
        return None

    async def rest(self) -> AsyncIterator[bytes]:
        await asyncio.sleep(self.delay)
        async for out in super().rest():
            yield out


async def test_an_idle_stream_is_pinged_within_its_interval():
    """The first `: ping` comes about one interval after the last message (the preamble here),
    not two: a proxy with an idle timeout between one and two intervals kept cutting streams."""
    source = _Slow(CHUNKS, delay=1.7)
    body, send = _loop_sender()
    await _run(SSEResponse(source, ping_interval=1.0), _client(asyncio.Event()), send)
    pings = [i for i, b in enumerate(body) if b.startswith(b": ping")]
    first = next(i for i, b in enumerate(body) if b"\"t\":1" in b)
    assert pings and pings[0] < first, body
