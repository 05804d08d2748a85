"""server.api.streaming.direct.DirectWriter on a real socket pair, writing an OpenAI stream
(server.api.generation.stream.ChoiceStream) from a delivering thread: the bytes equal the
event-loop path's, framed as HTTP/1.1 chunks, in order; a full socket hands the rest to the loop
without losing or reordering a byte; a closed socket aborts the sequence; stop() ends the
writes. (The whole path through uvicorn is in test_http_ops.)"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading

import orjson

from server.api.generation.jobs import Job
from server.api.generation.stream import ChoiceStream
from server.api.latency import Recorder
from server.api.openai.render import Meta, chat_renderer, completion_renderer
from server.api.streaming.direct import DirectWriter
from server.engine.handle import Deliveries, RequestHandle
from server.engine.types import Event, Result

_aborted: list[str] = []  # the request ids whose abort() a handle asked the engine for


def _handle() -> RequestHandle:
    """A handle as the engine makes it: alive, its abort() recorded in _aborted."""
    return RequestHandle("r", asyncio.get_running_loop(), alive=lambda: True,
                         abort=lambda rid: _aborted.append(rid) is None)  # fmt: skip


class _Transport:  # what DirectWriter needs of the loop's transport
    def __init__(self, buffered: int = 0):
        self.written, self.buffered = b"", buffered

    def write(self, data: bytes) -> None:
        self.written += data

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return False


def _events(n: int) -> list[tuple[Event, Result | None]]:
    out = [(Event(text=f" w{i}\u00e9", token_ids=[i], n_tokens=i + 1), None) for i in range(n - 1)]
    res = Result(request_id="r", text="", token_ids=[], prompt_tokens=2, completion_tokens=n,
                 finish_reason="length", prefill_time=0, gen_time=0)
    out.append((Event(text=" end", token_ids=[n], n_tokens=n, finished=True, finish_reason="length"), res))
    return out


def _source(kind, handle) -> ChoiceStream:
    meta = Meta(id="cmpl-x", model="m", created=1, prompt_tokens=2)
    jobs = [Job(index=0, handle=handle, prompt_tokens=2)]
    renderer = (chat_renderer if kind == "chat" else completion_renderer)(jobs, meta, True)
    return ChoiceStream(jobs, renderer, Recorder(None, 0.0))


def _framed(body: bytes) -> bytes:  # written out here, not direct.chunk: the test's own oracle
    return b"%x\r\n%b\r\n" % (len(body), body)


def _dechunk(raw: bytes) -> bytes:
    """The body of HTTP/1.1 chunks (each must be well framed)."""
    out, i = b"", 0
    while i < len(raw):
        j = raw.index(b"\r\n", i)
        n = int(raw[i:j], 16)
        assert raw[j + 2 + n : j + 4 + n] == b"\r\n", "bad chunk framing"
        out += raw[j + 2 : j + 2 + n]
        i = j + 4 + n
    return out


def _text(body: bytes) -> tuple[str, list[str], bool]:
    """(the streamed text, the finish reasons, whether [DONE] ends it) of an SSE body."""
    text, reasons, events = "", [], body.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        choices = orjson.loads(e.removeprefix("data: "))["choices"]
        for c in choices:
            text += c.get("text", "")
            if c["finish_reason"]:
                reasons.append(c["finish_reason"])
    return text, reasons, True


async def _loop_path(kind: str, steps) -> bytes:
    """The reference: the same deliveries through the event-loop generator (one wake-up each)."""
    h = _handle()
    source = _source(kind, h)
    out: list[bytes] = [_framed(c) for c in source.preamble]

    async def consume():
        async for c in source.rest():
            out.append(_framed(c))

    task = asyncio.create_task(consume())
    for group in steps:
        await asyncio.sleep(0.005)
        d = Deliveries()
        for ev, res in group:
            d.add(h, ev, res)
        d.deliver()
    await asyncio.wait_for(task, 5)
    return b"".join(out)


def _steps(events, per_step: int = 1) -> list[list]:
    return [events[i : i + per_step] for i in range(0, len(events), per_step)]


def _deliver_from_a_thread(h: RequestHandle, events, per_step: int = 1) -> None:
    def run():
        for group in _steps(events, per_step):
            d = Deliveries()
            for ev, res in group:
                d.add(h, ev, res)
            d.deliver()

    t = threading.Thread(target=run)
    t.start()
    t.join()


def _direct(kind: str, sock: socket.socket):
    h = _handle()
    source = _source(kind, h)
    ds = DirectWriter(source, _Transport(), os.dup(sock.fileno()), own_fd=True)
    return h, source, ds


def _read_all(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    out = b""
    while True:
        try:
            data = sock.recv(1 << 20)
        except BlockingIOError:
            return out
        if not data:
            return out
        out += data


def test_engine_thread_writes_equal_the_loop_path():
    async def main():
        for kind in ("completions", "chat"):
            events = _events(40)
            a, b = socket.socketpair()
            a.setblocking(False)
            h, source, ds = _direct(kind, a)
            pre = b"".join(_framed(c) for c in source.preamble)  # sent through uvicorn before start()
            ds.start()
            _deliver_from_a_thread(h, events[:10])
            _deliver_from_a_thread(h, events[10:], per_step=3)  # several events per delivery too
            assert await asyncio.wait_for(ds.left, 2) == "ended"
            assert source.ended and h._listener is None
            got = pre + _read_all(b)
            assert got == await _loop_path(kind, _steps(events[:10]) + _steps(events[10:], 3)), kind
            assert got.endswith(b"data: [DONE]\n\n\r\n") and b" w38" in got
            a.close(), b.close()

    asyncio.run(main())


def test_a_full_socket_hands_the_rest_to_the_loop_in_order():
    async def main():
        events = _events(3000)  # ~600 KB of chunks: far more than the socket buffers below
        a, b = socket.socketpair()
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        a.setblocking(False)
        h, source, ds = _direct("completions", a)
        ds.start()
        _deliver_from_a_thread(h, events[:2000])  # nobody reads b meanwhile: a write comes up short
        assert await asyncio.wait_for(ds.left, 2) == "slow"
        direct_part = _read_all(b)
        rest = ds.rest()
        first = await rest.__anext__()  # the loop path: the tail went to the transport first
        _deliver_from_a_thread(h, events[2000:])
        later = [c async for c in rest]
        got = direct_part + ds.transport.written + b"".join(_framed(c) for c in [first, *later])
        assert len(direct_part) > 0 and ds.transport.written  # both paths carried bytes
        text, reasons, _ = _text(_dechunk(got))  # batching differs after the hand-back, not the content
        assert text == "".join(ev.text for ev, _ in events) and reasons == ["length"]
        assert later and source.ended

    asyncio.run(main())


def _started() -> tuple[socket.socket, socket.socket, RequestHandle, DirectWriter]:
    a, b = socket.socketpair()
    a.setblocking(False)
    h, _, ds = _direct("completions", a)
    ds.start()
    return a, b, h, ds


def test_a_closed_socket_aborts_the_sequence():
    _aborted.clear()

    async def main():
        a, b, h, ds = _started()
        b.close()
        _deliver_from_a_thread(h, _events(5)[:2])
        assert await asyncio.wait_for(ds.left, 2) == "gone"
        assert _aborted == ["r"] and h._listener is None
        ds.source.close()  # the loop's cleanup: the sequence's abort was already asked for
        a.close()

    asyncio.run(main())


def test_stop_ends_the_engine_thread_writes():
    async def main():
        a, b, h, ds = _started()
        events = _events(10)
        _deliver_from_a_thread(h, events[:3])
        before = _read_all(b)
        assert before.count(b"data: ") == 3
        assert not ds.source.ended  # the end was not written: the caller ends the stream
        ds.stop()
        _deliver_from_a_thread(h, events[3:])
        assert _read_all(b) == b"" and h._listener is None
        assert await asyncio.wait_for(ds.left, 2) == "stopped"
        assert len(h._events) == 7  # left queued, not lost
        a.close(), b.close()

    asyncio.run(main())


def test_a_preamble_still_buffered_keeps_the_stream_on_the_loop():
    async def main():
        a, b = socket.socketpair()
        a.setblocking(False)
        h, source, ds = _direct("chat", a)
        ds.transport.buffered = 100  # uvicorn's transport still holds the role chunk
        ds.start()
        assert await asyncio.wait_for(ds.left, 2) == "slow" and h._listener is None
        events = _events(6)
        _deliver_from_a_thread(h, events)
        assert _read_all(b) == b""  # nothing went around the transport's queue
        body = b"".join(_framed(c) for c in source.preamble) + b"".join([_framed(c) async for c in ds.rest()])
        assert body == await _loop_path("chat", [events])
        a.close(), b.close()

    asyncio.run(main())


def test_direct_writes_apply_only_to_plain_http11_chunked_uvicorn_responses():
    from server.api.streaming.direct import transport_of

    class _T:
        def __init__(self, tls=False):
            self.tls = tls

        def get_extra_info(self, key):
            return object() if self.tls and key == "sslcontext" else None

    class _Cycle:  # the shape of uvicorn's httptools RequestResponseCycle
        def __init__(self, transport, chunked=True):
            self.transport, self.chunked_encoding, self.response_complete = transport, chunked, False

        async def send(self, message):
            pass

    plain, h11 = {"http_version": "1.1"}, {"http_version": "1.0"}
    t = _T()
    assert transport_of(_Cycle(t).send, plain) == (t, "")
    assert transport_of(_Cycle(t).send, h11)[0] is None
    assert transport_of(_Cycle(t, chunked=False).send, plain)[0] is None
    assert "TLS" in transport_of(_Cycle(_T(tls=True)).send, plain)[1]

    async def other_server_send(message):
        pass

    assert "httptools" in transport_of(other_server_send, plain)[1]


def test_a_client_gone_before_the_headers_says_no_reason_for_the_loop_path(caplog, monkeypatch):
    """uvicorn drops the response start of a client already gone, so the response is not chunked:
    no configuration reason to log (QA: that used up the reason's one log line, and misled)."""
    from server.api.streaming import direct

    class _Cycle:
        transport, chunked_encoding, response_complete = object(), None, False

        def __init__(self, disconnected):
            self.disconnected = disconnected

        async def send(self, message):
            pass

    class _Src:
        path, foreign_thread = "direct", False

    monkeypatch.setattr(direct, "_said", set())
    caplog.set_level(logging.INFO, logger=direct.log.name)
    assert direct.DirectWriter.attach(_Src(), _Cycle(True).send, {"http_version": "1.1"}) is None
    assert "not chunked" not in caplog.text
    assert direct.DirectWriter.attach(_Src(), _Cycle(False).send, {"http_version": "1.1"}) is None
    assert "the response is not chunked (logged once)" in caplog.text


def test_a_stream_ended_by_two_paths_records_its_duration_once():
    from server.api.metrics import Metrics

    m = Metrics()
    rec = Recorder(m, 0.0)
    rec.finish()  # e.g. the loop path's generator after a hand-back ...
    rec.finish()  # ... and ChoiceStream.close()
    assert m.e2e.count == 1
