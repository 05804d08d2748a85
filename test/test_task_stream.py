"""server.api.tasks.stream.TaskStream written by the direct writer (server.api.streaming.direct) on
a real socket pair, from the task's Output notifications: the bytes equal the loop path's (framed
as HTTP/1.1 chunks, in order) for any step pattern, a full socket hands the rest to the loop
without losing or repeating an event, an error ends with the error event, and a stream stopped
before its end says so (its own TMP_ task is aborted). The whole path through uvicorn is in
test_task_api_raw_http (metrics: task_direct_ended)."""

from __future__ import annotations

import asyncio
import socket

import orjson
import pytest
from test_sse_direct import _dechunk, _read_all

from server.api.streaming.direct import DirectWriter
from server.api.streaming.source import DONE
from server.api.tasks.stream import TaskStream
from server.tasks.records import Output, Task


class _Transport:  # what DirectWriter needs of the loop's transport
    def __init__(self, buffered: int = 0):
        self.written, self.buffered, self.closing = b"", buffered, False

    def write(self, data: bytes) -> None:
        self.written += data

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing


def _task() -> Task:
    t = Task(id="TMP_x", kind="tmp", prompt_tokens=3, gen_time=0.5, prefill_time=0.25)
    t.out = Output(finished=False)
    return t


STEPS = [[("Hello", 1)], [(" w\u00f6rld", 2)], [("", 1), ("!", 1)], [(" and", 1), (" more", 3)]]


def _apply(t: Task, step, last: bool, *, error: str | None = None, tail: str = "") -> None:
    for text, n in step:
        t.out.append(text, n)
    t.completion_tokens = len(t.out)
    if last:
        if tail:
            t.out.append(tail, 0)
        t.finish_reason = t.out.finish_reason = "error" if error else "length"
        t.out.error = error
        t.out.finished = True
    t.out.notify()


async def _loop_bytes(steps, **end) -> bytes:
    """The loop path's bytes for the same steps (a reader woken at every notify)."""
    t = _task()
    source = TaskStream(t, 0)
    got = list(source.preamble)

    async def read():
        async for chunk in source.rest():
            got.append(chunk)

    reader = asyncio.create_task(read())
    await asyncio.sleep(0)
    for i, step in enumerate(steps):
        _apply(t, step, i == len(steps) - 1, **end)
        await asyncio.sleep(0)
    await reader
    return b"".join(got)


def _text(body: bytes) -> str:
    events = [orjson.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    return "".join(e.get("data", "") for e in events)


class _Pair:
    """A direct writer on one end of a socket pair (the loop's own socket: not dup'ed)."""

    def __init__(self, t: Task, pos: int = 0, *, sndbuf: int | None = None) -> None:
        self.a, self.b = socket.socketpair()
        if sndbuf:
            self.a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            self.b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
        self.a.setblocking(False)
        self.aborted: list[bool] = []
        self.source = TaskStream(t, pos, lambda: self.aborted.append(True))
        self.tr = _Transport()
        self.ds = DirectWriter(self.source, self.tr, self.a.fileno(), own_fd=False)

    def written(self) -> bytes:
        return _dechunk(_read_all(self.b))

    def close(self) -> None:
        self.a.close(), self.b.close()


async def _direct_bytes(steps, **end) -> tuple[bytes, _Pair]:
    t = _task()
    p = _Pair(t)
    p.ds.start()
    for i, step in enumerate(steps):
        _apply(t, step, i == len(steps) - 1, **end)
    return b"".join(p.source.preamble) + p.written(), p


@pytest.mark.parametrize("end", [{}, {"tail": " (flushed)"}, {"error": "the engine failed"}],
                         ids=["final", "tail", "error"])
async def test_direct_writes_equal_the_loop_path(end):
    want = await _loop_bytes(STEPS, **end)
    got, p = await _direct_bytes(STEPS, **end)
    assert got == want and want.endswith(DONE)
    assert (await p.ds.left) == "ended" and p.source.ended
    assert ((b'"error"' in want) == ("error" in end)) and (b'"finished":true' in want) != ("error" in end)
    assert b"(flushed)" in want or "tail" not in end
    p.source.close()
    assert p.aborted == []  # it ended: nothing to abort
    assert p.ds.pump not in p.source.out._listeners  # left: no more writes
    p.close()


async def test_a_full_socket_hands_the_rest_to_the_loop_in_order():
    big = [[(f" word{i}" * 50, 1)] for i in range(400)]  # far more than the socket buffers below
    want = await _loop_bytes(big)
    t = _task()
    p = _Pair(t, sndbuf=4096)
    p.ds.start()
    for step in big[:300]:  # nobody reads meanwhile: a write comes up short
        _apply(t, step, False)
    assert (await p.ds.left) == "slow"
    direct_part = p.written()
    rest = []

    async def read_rest():
        async for chunk in p.ds.rest():
            rest.append(chunk)

    reader = asyncio.create_task(read_rest())
    await asyncio.sleep(0)
    for i, step in enumerate(big[300:]):
        _apply(t, step, i == len(big) - 301)
        await asyncio.sleep(0)
    await reader
    assert direct_part and p.tr.written  # both paths carried bytes, the tail through the transport
    got = b"".join(p.source.preamble) + direct_part + _dechunk(p.tr.written) + b"".join(rest)
    # batching differs after the hand-back, not the content: the same text, once, then the same end
    assert _text(got) == _text(want) and got.endswith(DONE) and p.source.ended
    assert got.split(b"\n\n")[-3:] == want.split(b"\n\n")[-3:]
    p.close()


async def test_stopped_before_the_end_says_so_and_aborts_its_own_task():
    t = _task()
    p = _Pair(t)
    p.ds.start()
    _apply(t, STEPS[0], False)
    assert not p.source.ended
    p.ds.stop()
    assert (await p.ds.left) == "stopped"
    before = p.written()
    _apply(t, STEPS[1], False)
    assert before and p.written() == b""  # no write after stop
    p.source.close()
    assert p.aborted == [True]
    p.close()


async def test_a_closing_transport_leaves_as_gone_and_aborts():
    t = _task()
    p = _Pair(t)
    p.ds.start()
    p.tr.closing = True  # the loop is closing the connection: its socket is not ours any more
    _apply(t, STEPS[0], False)
    assert (await p.ds.left) == "gone" and p.written() == b"" and p.aborted == [True]
    p.close()


async def test_a_stream_from_a_position_starts_there():
    t = _task()
    for step in STEPS[:2]:
        _apply(t, step, False)
    p = _Pair(t, pos=1)  # after token 1
    p.ds.start()  # writes what is there beyond pos at once
    body = p.written().decode()
    assert '"data":" w\\u00f6rld"' in body or '"data":" wörld"' in body
    assert "Hello" not in body and '"pos":3' in body
    p.close()


@pytest.mark.parametrize("path", ["loop", "direct"])
async def test_a_last_flush_reaches_a_reader_that_read_the_last_token(path):
    """A run that ends with text and no token (a stop's flush: a cut character's U+FFFD, text
    held back for a stop string) credits that text to its last token; a reader that had already
    read that token still gets it (it lacked it by characters, not by tokens)."""
    steps = [*STEPS[:2], []]  # the reader catches up after step 2; the end brings only the flush
    if path == "loop":
        body = await _loop_bytes(steps, tail="\ufffd")
    else:
        body, p = await _direct_bytes(steps, tail="\ufffd")
        p.close()
    assert _text(body) == "Hello w\u00f6rld\ufffd"
