"""server.api.task_stream: the task routes' direct writes give the bytes of the loop generator
(framed as HTTP/1.1 chunks, in order) for any step pattern, a slow transport hands the rest to
the loop without losing or repeating an event, an error ends with the error event, and a stream
stopped before its end says so (its own TMP_ task is aborted). The whole path through uvicorn is
in test_task_api_http (metrics: task_direct_ended)."""

from __future__ import annotations

import asyncio

import pytest
from test_sse_direct import _dechunk

from server.api import task_stream
from server.api.sse import DONE
from server.tasks.records import Output, Task


class _Transport:  # what TaskDirect needs of the loop's transport
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
    """The loop generator's bytes for the same steps (a reader woken at every notify)."""
    t = _task()
    got = []

    async def read():
        async for chunk in task_stream.body(t, 0, t.out):
            got.append(chunk)

    reader = asyncio.create_task(read())
    await asyncio.sleep(0)
    for i, step in enumerate(steps):
        _apply(t, step, i == len(steps) - 1, **end)
        await asyncio.sleep(0)
    await reader
    return b"".join(got)


async def _direct_bytes(steps, transport=None, **end) -> tuple[bytes, task_stream.TaskDirect, list]:
    t = _task()
    ends: list[bool] = []
    tr = transport or _Transport()
    ds = task_stream.TaskDirect(t, t.out, 0, tr, ends.append)
    ds.start()
    for i, step in enumerate(steps):
        _apply(t, step, i == len(steps) - 1, **end)
    return b"".join(ds.preamble) + _dechunk(tr.written), ds, ends


@pytest.mark.parametrize("end", [{}, {"tail": " (flushed)"}, {"error": "the engine failed"}],
                         ids=["final", "tail", "error"])
async def test_direct_writes_equal_the_loop_generator(end):
    want = await _loop_bytes(STEPS, **end)
    got, ds, ends = await _direct_bytes(STEPS, **end)
    assert got == want and want.endswith(DONE)
    assert (await ds.left) == "ended" and ds.ended and not ds.stop()
    assert ((b'"error"' in want) == ("error" in end)) and (b'"finished":true' in want) != ("error" in end)
    assert b"(flushed)" in want or "tail" not in end
    ds.close()
    assert ends == [True]
    assert ds.pump not in ds.out._listeners  # left: no more writes


async def test_a_slow_transport_hands_the_rest_to_the_loop_in_order():
    want = await _loop_bytes(STEPS)
    tr = _Transport()
    t = _task()
    ds = task_stream.TaskDirect(t, t.out, 0, tr, lambda finished: None)
    ds.start()
    _apply(t, STEPS[0], False)
    tr.buffered = task_stream.SLOW_BYTES + 1  # the client stopped reading
    _apply(t, STEPS[1], False)  # written (it fits the transport's buffer), then direct mode ends
    assert (await ds.left) == "slow"
    written = len(tr.written)
    rest = []

    async def read_rest():
        async for chunk in ds.rest():
            rest.append(chunk)

    reader = asyncio.create_task(read_rest())
    await asyncio.sleep(0)
    for i, step in enumerate(STEPS[2:]):
        _apply(t, step, i == len(STEPS) - 3)
        await asyncio.sleep(0)
    await reader
    assert len(tr.written) == written  # nothing more written behind the loop's back
    assert b"".join(ds.preamble) + _dechunk(tr.written) + b"".join(rest) == want and ds.ended


async def test_stopped_before_the_end_says_so_and_aborts_its_own_task():
    t = _task()
    ends: list[bool] = []
    tr = _Transport()
    ds = task_stream.TaskDirect(t, t.out, 0, tr, ends.append)
    ds.start()
    _apply(t, STEPS[0], False)
    assert ds.stop() is True and (await ds.left) == "stopped"  # the end was not written
    before = tr.written
    _apply(t, STEPS[1], False)
    assert tr.written == before  # no write after stop
    ds.close()
    assert ends == [False]


async def test_a_closing_transport_leaves_as_gone():
    tr = _Transport()
    t = _task()
    ds = task_stream.TaskDirect(t, t.out, 0, tr, lambda finished: None)
    ds.start()
    tr.closing = True
    _apply(t, STEPS[0], False)
    assert (await ds.left) == "gone" and tr.written == b""


async def test_a_stream_from_a_position_starts_there():
    t = _task()
    for step in STEPS[:2]:
        _apply(t, step, False)
    tr = _Transport()
    ds = task_stream.TaskDirect(t, t.out, 1, tr, lambda finished: None)  # after token 1
    ds.start()  # writes what is there beyond pos at once
    body = _dechunk(tr.written).decode()
    assert '"data":" w\\u00f6rld"' in body or '"data":" wörld"' in body
    assert "Hello" not in body and '"pos":3' in body
