"""Direct SSE writes: a one-choice stream's chunks written to its socket by the engine thread.

Why: at hundreds of streams the event loop's work per token (a task wake-up, the generator chain,
uvicorn's send, the write syscall: ~20-30 us, all but the syscall holding the GIL) was what held
the HTTP path below the engine. A DirectStream is the handle's listener (RequestHandle.
set_listener): right after the engine thread pushed a step's events it renders the stream's bytes
(openai_stream.Parts) and writes them, chunk-framed, to a dup of the connection's socket, while
the device runs the next step. The event loop does nothing per token. (The write keeps the GIL:
the socket is non-blocking, and 256 GIL hand-offs a step to a busy loop cost more; see _write.)

It applies (`attach`) when: Settings.direct_stream is on; the server is uvicorn's httptools
protocol (its send is bound to a cycle that holds the transport); HTTP/1.1 with a chunked body; a
plain TCP transport (no TLS); one job; nothing buffered in the transport at takeover. Otherwise
the stream runs on the event loop as before (server.api.sse).

One writer at a time (self._lock): the loop sends the headers and the preamble through uvicorn,
then `start()` (listener set, first pump; if the transport still buffers the preamble, the stream
stays on the loop as for "slow"); the engine thread pumps after each delivery, the loop
only to ping. The stream leaves direct mode (`_leave`: listener dropped, dup closed, the loop
told through `self.left`) when:
  * "ended": its last bytes (finish chunk, usage, [DONE]) are written;
  * "slow": a write did not fit the socket buffer (a client that reads slowly): the rest of that
    write goes out through the transport (which buffers and applies flow control) and the rest of
    the stream through the event loop (`rest()`), so a slow client never blocks the engine;
  * "gone": the socket refused a write (the client left): its sequence is aborted;
  * "stopped": the loop called stop() (disconnect seen, server draining);
  * "failed": rendering raised (logged; the loop ends the stream with an error event).
The loop finishes the response through uvicorn in every case (the chunked terminator).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import threading
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from server.api.generation import Job, Recorder, _record, abort_all, failed_batch

log = logging.getLogger("server.sse")


def _gil_holding_write() -> Callable[[int, bytes], int] | None:
    """write(2) called WITHOUT releasing the GIL (ctypes.PyDLL), or None where unavailable.
    The socket is non-blocking, so a call never waits; releasing the GIL 256 times a step (as
    os.write does) would let a busy event loop take it at each write and hold it for up to the
    interpreter's switch interval, stretching the engine thread's delivery."""
    if os.name != "posix":
        return None
    try:
        fn = ctypes.PyDLL(None, use_errno=True).write
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t), ctypes.c_ssize_t

    def write(fd: int, data: bytes) -> int:
        n = fn(fd, data, len(data))
        if n < 0:
            code = ctypes.get_errno()
            raise (BlockingIOError if code in (errno.EAGAIN, errno.EWOULDBLOCK) else OSError)(code, os.strerror(code))
        return n

    return write


_write = _gil_holding_write() or os.write


def chunk(body: bytes) -> bytes:
    """body as one HTTP/1.1 chunk (what uvicorn's send writes for a chunked body message)."""
    return b"%x\r\n%b\r\n" % (len(body), body)


def transport_of(send: Callable, scope: dict) -> tuple[Any | None, str]:
    """(the plain-TCP transport behind uvicorn's httptools send for this HTTP/1.1 chunked
    response, "") or (None, why not)."""
    cycle = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if transport is None:
        return None, "the server is not uvicorn's httptools protocol (install httptools: uvicorn[standard])"
    if scope.get("http_version") != "1.1":
        return None, "HTTP/1.0 client"
    if getattr(cycle, "chunked_encoding", None) is not True or getattr(cycle, "response_complete", True):
        return None, "the response is not chunked"
    if transport.get_extra_info("sslcontext") is not None or transport.get_extra_info("ssl_object") is not None:
        return None, "TLS connection"
    return transport, ""


def idle_transport(send: Callable, scope: dict) -> Any | None:
    """transport_of's transport when it can take direct writes now (nothing buffered, not
    closing), else None (the reason it is not ours logged once)."""
    transport, why = transport_of(send, scope)
    if transport is None:
        _say_once(why)
        return None
    if transport.get_write_buffer_size() or transport.is_closing():
        return None
    return transport


_said: set[str] = set()


def _say_once(why: str) -> None:
    """Log, once per reason, why streams take the event loop instead (a slower path)."""
    if why not in _said:
        _said.add(why)
        log.info("SSE streams on the event loop, not direct writes: %s (logged once)", why)


class DirectStream:
    kind = "direct"  # the metrics' stream path: direct_<why it left>

    def __init__(self, parts: Any, recorder: Recorder, transport: Any, fd: int) -> None:
        self.parts, self.recorder, self.transport, self.fd = parts, recorder, transport, fd
        self.job: Job = parts.jobs[0]
        self.handle = self.job.handle
        self.loop = asyncio.get_running_loop()
        self.left: asyncio.Future = self.loop.create_future()  # result: why direct mode ended
        self.sent = 0  # chunks written (the pinger's "was anything sent lately")
        self.ended = False  # the stream's last bytes were produced
        self._lock = threading.Lock()
        self._state = "new"
        self._tail = b""  # the unsent rest of a partial write ("slow")

    @property
    def preamble(self) -> list[bytes]:
        """The chunks the loop sends before start()."""
        return self.parts.preamble

    @classmethod
    def attach(cls, parts: Any, recorder: Recorder, send: Callable, scope: dict) -> "DirectStream | None":
        """A DirectStream for this response once its headers went out, or None."""
        if len(parts.jobs) != 1 or not hasattr(parts.jobs[0].handle, "set_listener"):
            return None
        transport = idle_transport(send, scope)
        if transport is None:
            return None
        sock = transport.get_extra_info("socket")
        try:
            fd = os.dup(sock.fileno())  # ours: the socket cannot be closed (and its number reused) under us
        except (AttributeError, OSError, ValueError):
            return None
        if os.get_blocking(fd):  # the loop's socket is non-blocking; anything else: not ours to change
            os.close(fd)
            return None
        return cls(parts, recorder, transport, fd)

    # --- direct mode ------------------------------------------------------------------------
    def start(self) -> None:
        """Loop thread, after the preamble: from now on the engine thread writes."""
        with self._lock:
            if self.transport.get_write_buffer_size():  # the preamble is still queued there: keep
                self._leave("slow")  # the byte order, stay on the loop
                return
            self._state = "live"
        self.handle.set_listener(self.pump)
        self.pump()  # the events that came before the listener

    def pump(self) -> None:
        """Write every pending event's bytes (engine thread after a delivery, or loop thread)."""
        with self._lock:
            if self._state != "live":
                return
            try:
                while True:
                    item = self._next()
                    if item is None:
                        return
                    out, last = item
                    if out and not self._write(out):
                        return
                    if last:
                        self._leave("ended")
                        return
            except Exception:  # noqa: BLE001 - a rendering bug: the loop ends the stream
                log.exception("direct stream of %s failed", self.handle.request_id)
                self._leave("failed")

    def ping(self, body: bytes) -> bool:
        """Loop thread: write a keep-alive comment; False when not in direct mode."""
        with self._lock:
            return self._state == "live" and self._write(body)

    def stop(self) -> bool:
        """Loop thread (disconnect, drain): leave direct mode now; True if the stream's end was
        not written (the caller may still end it)."""
        with self._lock:
            if self._state in ("new", "live"):
                self._leave("stopped")
            return not self.ended

    def _next(self) -> tuple[bytes, bool] | None:
        """The next pending batch's bytes (what next_batch + generation._events_one +
        openai_stream.Parts.rest do, without waiting), None when nothing is pending."""
        try:
            batch = self.handle.take_ready()
        except Exception as exc:  # noqa: BLE001 - the engine failed this request: an error event
            batch = failed_batch(self.job, exc)
        if batch is None:
            return None
        if not batch:  # ended without a finishing event
            self.ended = True
            return self.parts.end(), True
        return self._take(batch)

    def _take(self, batch: list) -> tuple[bytes, bool]:
        job = self.job
        _record(job, batch, self.recorder)
        if job.finish_reason == "error" and job.error is None:
            res = self.handle.peek_result()  # delivered with the finishing event
            job.error = (getattr(res, "error", None) or "generation failed")
        out, last = self.parts.take(job, batch)
        self.ended = self.ended or last
        return out, last

    def _write(self, body: bytes) -> bool:
        data = chunk(body)
        try:
            n = _write(self.fd, data)
        except BlockingIOError:
            n = 0
        except OSError as exc:
            log.info("client gone while streaming (%s); aborting its generation", type(exc).__name__)
            self._leave("gone")
            return False
        self.sent += 1
        if n < len(data):
            self._tail = data[n:]
            self._leave("slow")
            return False
        return True

    def _leave(self, why: str) -> None:  # under self._lock
        self._state = why
        self.handle.set_listener(None)
        try:
            os.close(self.fd)
        except OSError:
            pass
        if why == "gone":
            self.handle.abort()
        try:
            self.loop.call_soon_threadsafe(_resolve, self.left, why)
        except RuntimeError:  # the loop is closed: nobody is waiting
            pass

    # --- after direct mode (loop thread) -------------------------------------------------------
    async def rest(self) -> AsyncIterator[bytes]:
        """After "slow": the unsent bytes straight to the transport (already framed), then the
        stream's remaining chunks on the event loop (openai_stream.Parts.rest), for the caller to
        send through uvicorn."""
        if self._tail:
            self.transport.write(self._tail)
            self._tail = b""
        async with aclosing(self.parts.rest(self.recorder)) as outs:
            async for out in outs:
                yield out
        self.ended = True

    def close(self) -> None:
        """The stream is over (any way): abort an unfinished sequence, record the duration."""
        abort_all([self.job])
        self.recorder.finish()


def _resolve(fut: asyncio.Future, value: str) -> None:
    if not fut.done():
        fut.set_result(value)
