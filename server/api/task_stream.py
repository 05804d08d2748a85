"""A task's SSE stream (/v1/tasks/*, stream=true), two ways with the same bytes.

`body()`: the event-loop generator (streaming.batches -> one write per wake-up), for any reader.

`TaskDirect`: the same events written to the connection's transport straight from the task's
Output notifications (Output.listen: called on the loop right after the run's pump appended a
step's text, or after the task finished). Why: at hundreds of streams the reader's per-token work
(its wake-up, the generator chain, uvicorn's send: ~30 us of the ~50 us a token cost the loop in
the CPU harness) bounded the task routes well below the completions route's direct writes
(server.api.direct, which the engine thread does; here the pump still has to update the task on
the loop, so the loop writes too). SSEResponse drives it through the same protocol as
DirectStream (preamble, start, left, rest, ping, stop, close, sent, ended), so disconnects,
drains and pings behave as on the loop. Conditions are DirectStream's (direct.transport_of:
uvicorn's httptools protocol, HTTP/1.1 chunked, plain TCP); it leaves direct mode when:
  * "ended": the final (or error) event and [DONE] are written;
  * "slow": the transport holds more than SLOW_BYTES unsent (a slow reader): the rest of the
    stream goes through `rest()` (the loop generator from the position reached, uvicorn's flow
    control); the bytes already written stay queued in order;
  * "gone": the transport is closing (the client left);
  * "stopped": SSEResponse stopped it (disconnect, drain);
  * "failed": rendering raised (logged; the response ends with an error event).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from server.api.direct import chunk, idle_transport
from server.api.sse import DONE, event
from server.tasks import streaming

log = logging.getLogger("server.sse")

SLOW_BYTES = 64 * 1024  # asyncio's default high-water mark: beyond it uvicorn would wait for drain


def _bytes(batch: list[Any]) -> tuple[bytes, bool]:
    """One write's bytes for a batch of events; True when it ends the stream ([DONE] added)."""
    data = event(batch[0]) if len(batch) == 1 else b"".join(map(event, batch))
    if batch and streaming.is_last(batch[-1]):
        return data + DONE, True
    return data, False


async def body(t: Any, pos: int, out: Any, *, on_end: Callable[[bool], None] | None = None,
               header: bool = True) -> AsyncIterator[bytes]:
    """The stream on the event loop from token `pos`: the header (unless header=False), text
    events, the final event, [DONE]. on_end(finished) runs when it stops, however it stops."""
    finished = False
    try:
        if header:
            yield event(streaming.header(t))
        # SSEResponse pings idle streams; one write per wake-up (the end: final event + [DONE])
        async for batch in streaming.batches(t, pos, ping=None, out=out):
            data, finished = _bytes(batch)
            yield data
        if not finished:
            finished = True
            yield DONE
    finally:
        if on_end is not None:
            on_end(finished)


class TaskDirect:
    kind = "task_direct"  # the metrics' stream path: task_direct_<why it left>

    def __init__(self, t: Any, out: Any, pos: int, transport: Any, on_end: Callable[[bool], None]) -> None:
        self.t, self.out, self.transport, self.on_end = t, out, transport, on_end
        self.pos = max(0, min(int(pos), len(out)))
        self.preamble = [event(streaming.header(t))]
        self.left: asyncio.Future = asyncio.get_running_loop().create_future()  # why it left
        self.sent = 0  # chunks written (the pinger's "was anything sent lately")
        self.ended = False  # the stream's last bytes were produced
        self._state = "new"

    @classmethod
    def attach(cls, t: Any, out: Any, pos: int, on_end: Callable[[bool], None],
               send: Callable, scope: dict) -> "TaskDirect | None":
        """A TaskDirect for this response once its headers went out, or None (the loop path)."""
        transport = idle_transport(send, scope)
        return None if transport is None else cls(t, out, pos, transport, on_end)

    def start(self) -> None:
        """After the preamble went out through uvicorn: from now on the notifications write."""
        if self.transport.get_write_buffer_size():  # the preamble still queued: stay in order
            self._leave("slow")
            return
        self._state = "live"
        self.out.listen(self.pump)
        self.pump()  # what came before

    def pump(self) -> None:
        """Write what the Output has beyond self.pos (Output.notify, on the loop)."""
        if self._state != "live":
            return
        try:
            data, last = self._render()
        except Exception:  # noqa: BLE001 - a rendering bug: the response ends with an error event
            log.exception("direct stream of task %s failed", self.t.id)
            self._leave("failed")
            return
        if data and not self._write(data):
            return
        if last:
            self.ended = True
            self._leave("ended")
        elif self.transport.get_write_buffer_size() > SLOW_BYTES:
            self._leave("slow")

    def _render(self) -> tuple[bytes, bool]:
        """What streaming.batches yields at a wake-up now, as bytes (b"": nothing new)."""
        out, n = self.out, len(self.out)
        batch: list[Any] = []
        if n > self.pos:
            batch, self.pos = streaming.new_text(self.t, out, self.pos, n), n
        if out.finished:
            batch += streaming.closing_events(self.t, out, self.pos)
        return _bytes(batch) if batch else (b"", False)

    def _write(self, data: bytes) -> bool:
        if self.transport.is_closing():
            self._leave("gone")
            return False
        self.transport.write(chunk(data))
        self.sent += 1
        return True

    def ping(self, body: bytes) -> bool:
        """Write a keep-alive comment; False when not in direct mode."""
        return self._state == "live" and self._write(body)

    def stop(self) -> bool:
        """Leave direct mode now (disconnect, drain); True if the stream's end was not written."""
        if self._state in ("new", "live"):
            self._leave("stopped")
        return not self.ended

    def _leave(self, why: str) -> None:
        self._state = why
        self.out.unlisten(self.pump)
        if not self.left.done():
            self.left.set_result(why)

    async def rest(self) -> AsyncIterator[bytes]:
        """After "slow": the stream's remaining chunks on the event loop, from self.pos."""
        async for chunk in body(self.t, self.pos, self.out, header=False):
            yield chunk
        self.ended = True

    def close(self) -> None:
        """The stream is over, any way."""
        self.on_end(self.ended)
