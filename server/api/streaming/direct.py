"""Direct writes: a stream's chunks written to its socket by the source's own notifications.

Why: at hundreds of streams the event loop's work per token (a task wake-up, the generator chain,
uvicorn's send, the write syscall, all but the syscall holding the GIL) is what holds the HTTP
path below the engine. A DirectWriter is the source's listener (StreamSource.listen): right after
new events arrived it takes the stream's bytes (`source.take()`) and writes them, chunk-framed,
to the connection's socket. For a one-choice OpenAI stream the listener runs on the engine thread
after each delivery (the loop does nothing per token); for a task stream it runs on the loop
right after the run's pump appended a step's text (no reader task per stream).

It applies (`attach`) when Settings.direct_stream is on, the source has a `path`, the server is
uvicorn's httptools protocol (its send is bound to a cycle that holds the transport), HTTP/1.1
with a chunked body, a plain TCP transport (no TLS), and nothing is buffered in the transport at
takeover. Otherwise the stream runs on the event loop (server.api.streaming.sse).

One writer at a time (self._lock): the loop sends the headers and the preamble through uvicorn,
then `start()` (listener set, first pump; if the transport still buffers the preamble, the stream
stays on the loop as for "slow"); the notifications pump, the loop only pings. The stream leaves
direct mode (`_leave`: listener dropped, the loop told through `self.left`) when:
  * "ended": its last bytes (final chunk, usage, [DONE]) are written;
  * "slow": a write did not fit the socket buffer (a client that reads slowly): the rest of that
    write goes out through the transport (which buffers and applies flow control) and the rest of
    the stream through the event loop (`rest()`), so a slow client never blocks the writer;
  * "gone": the socket refused a write (the client left): the source aborts its work;
  * "stopped": the loop called stop() (disconnect seen, server draining);
  * "failed": rendering raised (logged; the loop ends the stream with an error event).
The loop finishes the response through uvicorn in every case (the chunked terminator).

A writer on another thread writes to a dup of the socket (the loop cannot close it, and its
number cannot be reused, under the writer), keeping the GIL; a writer on the loop writes to the
socket itself with os.write, after checking the transport is not closing (the loop closes
sockets only between callbacks).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import threading
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.types import Scope

from server.api.streaming.source import StreamSource

log = logging.getLogger("server.sse")


def _gil_holding_write() -> Callable[[int, bytes], int] | None:
    """write(2) called WITHOUT releasing the GIL (ctypes.PyDLL), or None where unavailable.
    The socket is non-blocking, so a call never waits; releasing the GIL at every write (as
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
        return int(n)

    return write


_write = _gil_holding_write() or os.write


def chunk(body: bytes) -> bytes:
    """body as one HTTP/1.1 chunk (what uvicorn's send writes for a chunked body message)."""
    return b"%x\r\n%b\r\n" % (len(body), body)


def transport_of(send: Callable[..., Any], scope: Scope) -> tuple[Any | None, str]:
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


_said: set[str] = set()


def _say_once(why: str) -> None:
    """Log, once per reason, why streams take the event loop instead (a slower path)."""
    if why not in _said:
        _said.add(why)
        log.info("SSE streams on the event loop, not direct writes: %s (logged once)", why)


class DirectWriter:
    def __init__(self, source: StreamSource, transport: Any, fd: int, *, own_fd: bool) -> None:
        self.source, self.transport, self.fd, self._own_fd = source, transport, fd, own_fd
        # another thread's writes keep the GIL (see _gil_holding_write); the loop's need not
        self._syscall = _write if source.foreign_thread else os.write
        self.loop = asyncio.get_running_loop()
        self.left: asyncio.Future[str] = self.loop.create_future()  # result: why direct mode ended
        self.sent = 0  # chunks written (the pinger's "was anything sent lately")
        self._lock = threading.Lock()
        self._state = "new"
        self._tail = b""  # the unsent rest of a partial write ("slow")

    @classmethod
    def attach(cls, source: StreamSource, send: Callable[..., Any], scope: Scope) -> DirectWriter | None:
        """A DirectWriter for this response once its headers went out, or None (the loop path)."""
        if source.path is None:
            return None
        transport, why = transport_of(send, scope)
        if transport is None:
            cycle = getattr(send, "__self__", None)
            if not getattr(cycle, "disconnected", False):  # (a client gone before the headers: no reason to say)
                _say_once(why)
            return None
        if transport.get_write_buffer_size() or transport.is_closing():
            return None
        own = source.foreign_thread
        try:
            fileno = transport.get_extra_info("socket").fileno()
            fd = os.dup(fileno) if own else fileno
        except (AttributeError, OSError, ValueError):
            return None
        if os.get_blocking(fd):  # the loop's socket is non-blocking; anything else: not ours to change
            if own:
                os.close(fd)
            return None
        return cls(source, transport, fd, own_fd=own)

    @property
    def state(self) -> str:
        """Its mode: "new", "live", or why direct mode ended (ended, slow, gone, stopped, failed)."""
        return self._state

    # --- direct mode ------------------------------------------------------------------------
    def start(self) -> None:
        """Loop thread, after the preamble: from now on the notifications write."""
        with self._lock:
            if self.transport.get_write_buffer_size():  # the preamble is still queued there: keep
                self._leave("slow")  # the byte order, stay on the loop
                return
            self._state = "live"
        self.source.listen(self.pump)
        self.pump()  # what came before the listener

    def pump(self) -> None:
        """Write what is pending (the source's listener, or the loop at start). One take() is
        all: it takes everything pending, and whatever comes later notifies again."""
        with self._lock:
            if self._state != "live":
                return
            try:
                item = self.source.take()
            except Exception:  # a rendering bug (logged): the loop ends the stream
                log.exception("direct stream failed")
                self._leave("failed")
                return
            if item is None:
                return
            out, last = item
            if out and not self._write(out):
                return
            if last:
                self._leave("ended")

    def ping(self, body: bytes) -> bool:
        """Loop thread: write a keep-alive comment; False when not in direct mode."""
        with self._lock:
            return self._state == "live" and self._write(body)

    def stop(self) -> None:
        """Loop thread (disconnect, drain, the end): leave direct mode now if still in it."""
        with self._lock:
            if self._state in ("new", "live"):
                self._leave("stopped")

    def _write(self, body: bytes) -> bool:
        if not self._own_fd and self.transport.is_closing():  # the loop closes it: not ours any more
            self._leave("gone")
            return False
        data = chunk(body)
        try:
            n = self._syscall(self.fd, data)
        except BlockingIOError:
            n = 0
        except OSError as exc:
            log.info(
                "client gone while streaming (%s); %s",
                type(exc).__name__,
                "aborting its generation" if self.source.stops_work else "the run it watched goes on",
            )
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
        self.source.listen(None)
        if self._own_fd:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        if why == "gone":
            self.source.abort()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(_resolve, self.left, why)

    # --- after direct mode (loop thread) -------------------------------------------------------
    async def rest(self) -> AsyncGenerator[bytes, None]:
        """After "slow": the unsent bytes straight to the transport (already framed), then the
        stream's remaining chunks on the event loop (source.rest()), for the caller to send."""
        if self._tail:
            self.transport.write(self._tail)
            self._tail = b""
        chunks = self.source.rest()
        try:
            async for out in chunks:
                yield out
        finally:
            await chunks.aclose()


def _resolve(fut: asyncio.Future[str], value: str) -> None:
    if not fut.done():
        fut.set_result(value)
