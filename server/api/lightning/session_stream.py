"""A session run's answer: lightning's native SSE read from the task's output (a StreamSource,
server.api.streaming.source), or the wait for its end when not streamed. A client that leaves
before the end stops the run (what was generated stays in the session, as on lightning).

A server shutdown ends the answer (the stream with the text generated so far and not yet sent,
then a `shutting_down` event; the wait with a 503) and its run as `interrupted`, as the shutdown
ends every run (services.end_run; docs/task-api.md: the server stopped while it ran; `stopped` is
a /stop or a client that left): the next call after a restart goes on from it.

A session deleted while a call on it generates (/state/delete: the run is stopped) ends that
call's answer with an error, `session_deleted` (a 404, or the stream's error event after the text
it sent), never as if the answer were whole."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Literal, cast

from fastapi import Request

from server.api.errors import ApiError, task_error
from server.api.lightning.render import native_chunk
from server.api.services import end_run
from server.api.streaming.source import DONE, event
from server.api.streaming.sse import chat_error_end
from server.api.streaming.watch import done_or_gone
from server.tasks import streaming
from server.tasks.errors import TaskError

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task


def deleted_error(name: str, tokens: int) -> ApiError:
    """The answer of a session call whose session was deleted while it generated."""
    return ApiError(
        404,
        f"session {name!r} was deleted while this call generated: its answer was cut after {tokens} tokens",
        param="session_id",
        code="session_deleted",
    )


class SessionStream:
    """The run's text as native chunks of `chunk_size` tokens (index 0), then `tail` (e.g.
    multi_state's node event) and [DONE]; an error ends it with `data: {"error": ...}` and
    [DONE] (after the text not sent yet), as does the session's deletion (`deleted()` says
    whether a stopped run was). Sessions are chats, not the throughput path: the stream runs on
    the event loop."""

    path = None  # no direct writes
    foreign_thread = False

    def __init__(
        self,
        t: Task,
        chunk_size: int,
        tail: bytes,
        on_abort: Callable[[], None],
        *,
        name: str,
        deleted: Callable[[], bool] = lambda: False,
    ) -> None:
        self.t, self.out = t, t.out  # this run's output, whatever the task does later
        self.chunk_size, self.tail = chunk_size, tail
        self.on_abort: Callable[[], None] | None = on_abort
        self.stops_work = True
        self.name, self.deleted = name, deleted
        self._ended = False
        self._sent = 0  # characters of out.text sent (the text events are its pieces, in order)

    @property
    def preamble(self) -> list[bytes]:
        return []

    @property
    def ended(self) -> bool:
        return self._ended

    def take(self) -> tuple[bytes, bool] | None:
        return None  # (only called in direct mode)

    async def rest(self) -> AsyncGenerator[bytes, None]:
        text, flushed = "", 0  # text not yet sent; output tokens at the last flush
        async for batch in streaming.batches(self.t, 0, ping=None, out=self.out):
            chunks = []
            for ev in cast(Sequence[streaming.Event], batch):  # (ping=None: no KEEPALIVE)
                if streaming.is_last(ev):
                    if text:
                        chunks.append(self._chunk(text))
                    chunks.append(self._last(ev) + DONE)
                    self._ended = True
                elif "data" in ev:
                    text += ev["data"]
                    if ev["pos"] - flushed >= self.chunk_size:
                        chunks.append(self._chunk(text))
                        text, flushed = "", ev["pos"]
            if chunks:
                yield b"".join(chunks)
        if not self._ended:
            self._ended = True
            yield DONE

    def _chunk(self, text: str) -> bytes:
        self._sent += len(text)
        return native_chunk(0, text)

    def _last(self, ev: dict[str, object]) -> bytes:
        """The events before [DONE]: the run's error, the deletion of its session, or `tail`."""
        if "error" in ev:
            return event(ev)
        if ev.get("finish_reason") == "stopped" and self.deleted():
            return event(deleted_error(self.name, len(self.out)).body())
        return self.tail

    async def error_end(self, why: Literal["shutdown", "internal"]) -> bytes:
        """SSEResponse's `error_end` (the server shuts down under the stream): the text generated
        and not sent yet (whatever chunk_size), then the error event and [DONE]."""
        rest = self.out.text[self._sent :]
        self._sent += len(rest)
        return (native_chunk(0, rest) if rest else b"") + chat_error_end(why)

    def listen(self, fn: Callable[[], None] | None) -> None:
        pass  # (direct mode only)

    def abort(self) -> None:
        if self.on_abort is not None and not self._ended:
            on_abort, self.on_abort = self.on_abort, None
            on_abort()

    def close(self) -> None:
        self.abort()


def stopper(request: Request, tasks: TaskManager, t: Task) -> Callable[[], None]:
    """What ends t's run when its answer ends early (services.end_run: stopped, or interrupted
    once the server is shutting down)."""
    return lambda: end_run(request, tasks, t)


async def settle(request: Request, tasks: TaskManager, t: Task, owner: str | None) -> bool:
    """Wait until the run ended; False when the client left first (the run is stopped then).
    503 when the server begins to shut down meanwhile (the shutdown ends the run `interrupted`)."""
    stop = stopper(request, tasks, t)
    try:
        if await done_or_gone(request, tasks.wait(t.id, owner)):
            return True
    except TaskError as exc:  # e.g. the session deleted meanwhile: its error, not a 500
        raise task_error(exc) from None
    except ApiError:
        stop()
        raise
    stop()
    return False
