"""A task's SSE stream (/v1/tasks/*, stream=true) as a StreamSource
(server.api.streaming.source), from any token position of the task's Output.

Bytes: a header event {task_id, prefill_time}, text events, then the final event (or an error
event) and [DONE] (the events themselves: server.tasks.streaming). On the event loop (`rest`)
one write per wake-up; with direct writes (server.api.streaming.direct) `take()` runs at every
Output notification, on the loop right after the run's pump appended a step's text, so no reader
task waits per stream. Both give the same bytes.

The Output is bound at creation: the stream shows that output, whatever the task does later (e.g.
a continue with a new prompt). A streaming request's own TMP_ task is aborted when its stream
stops before the end (`abort_on_close`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from typing import cast

from server.api.streaming.source import DONE, event
from server.tasks import streaming
from server.tasks.records import Task


def _bytes(batch: Sequence[streaming.Event]) -> tuple[bytes, bool]:
    """One write's bytes for a batch of events; True when it ends the stream ([DONE] added)."""
    data = event(batch[0]) if len(batch) == 1 else b"".join(map(event, batch))
    if batch and streaming.is_last(batch[-1]):
        return data + DONE, True
    return data, False


class TaskStream:
    path = "task_direct"
    foreign_thread = False  # Output notifications run on the event loop

    def __init__(self, t: Task, pos: int, on_abort: Callable[[], None] | None = None) -> None:
        """on_abort(): what to stop when the stream ends before its end (the client left)."""
        self.t, self.out = t, t.out
        self.pos = max(0, min(int(pos), len(self.out)))
        self.sent = self.out.char_at(self.pos)  # characters of the text sent (streaming.closing_events)
        self.on_abort = on_abort
        self.stops_work = on_abort is not None
        self._ended = False
        self._fn: Callable[[], None] | None = None  # the listener (direct writes)
        self._preamble = [event(streaming.header(t))]

    @property
    def preamble(self) -> list[bytes]:
        return self._preamble

    @property
    def ended(self) -> bool:
        return self._ended

    def take(self) -> tuple[bytes, bool] | None:
        """What streaming.batches yields at a wake-up now, as bytes (None: nothing new)."""
        out, n = self.out, len(self.out)
        batch: list[streaming.Event] = []
        if n > self.pos:
            batch, self.pos, self.sent = streaming.new_text(self.t, out, self.pos, n), n, out.char_at(n)
        if out.finished:
            batch += streaming.closing_events(self.t, out, self.pos, self.sent)
        if not batch:
            return None
        data, last = _bytes(batch)
        self._ended = self._ended or last
        return data, last

    async def rest(self) -> AsyncGenerator[bytes, None]:
        """The events from self.pos on the event loop, one write per wake-up (the end: final
        event + [DONE]). SSEResponse pings idle streams, so no timer per wait here."""
        async for items in streaming.batches(self.t, self.pos, ping=None, out=self.out, sent=self.sent):
            data, last = _bytes(cast(Sequence[streaming.Event], items))  # (ping=None: no KEEPALIVE)
            self._ended = self._ended or last
            yield data
        if not self._ended:
            self._ended = True
            yield DONE

    def listen(self, fn: Callable[[], None] | None) -> None:
        if self._fn is not None:
            self.out.unlisten(self._fn)
        self._fn = fn
        if fn is not None:
            self.out.listen(fn)

    def abort(self) -> None:
        if self.on_abort is not None and not self._ended:
            on_abort, self.on_abort = self.on_abort, None  # once
            on_abort()

    def close(self) -> None:
        self.listen(None)
        self.abort()
