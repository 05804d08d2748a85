"""A streamed response's SSE events (`event: <type>` + `data: {..., "type", "sequence_number"}`)
as a StreamSource (server.api.streaming.source), sent by SSEResponse: that response watches the
client, and when it leaves before the last event the source's `abort` stops the run (a response
is tied to its request: docs/agents.md, "The Responses API"). Responses are chats, not the
throughput path: the stream runs on the event loop (no direct writes)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson

from server.api.responses.render import continues, message, response
from server.tasks import streaming
from server.tasks.records import Task

_LAST = {"completed": "response.completed", "failed": "response.failed"}
"""The last event's type by the final status (any other: response.incomplete)."""


class _Events:
    """Numbered SSE events (sequence_number counts from 0 over the whole stream)."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **data: Any) -> bytes:
        body = orjson.dumps({"type": kind, "sequence_number": self.seq, **data})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


class ResponseStream:
    path = None  # no direct writes
    foreign_thread = False

    def __init__(self, t: Task, model: str, on_abort: Callable[[], None]) -> None:
        """on_abort(): stop the run (called once, when the stream stops before its last event)."""
        self.t, self.model = t, model
        self.on_abort: Callable[[], None] | None = on_abort
        self._ended = False
        self._ev = _Events()
        item = message(t, "", "in_progress")
        item["content"] = []
        self._part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._loc = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        head = response(t, model, output=False)
        self._preamble = [
            self._ev("response.created", response=head)
            + self._ev("response.in_progress", response=head)
            + self._ev("response.output_item.added", output_index=0, item=item)
            + self._ev("response.content_part.added", **self._loc, part=self._part)
        ]

    @property
    def preamble(self) -> list[bytes]:
        return self._preamble

    @property
    def ended(self) -> bool:
        return self._ended

    def take(self) -> tuple[bytes, bool] | None:
        return None  # (direct mode only)

    async def rest(self) -> AsyncGenerator[bytes, None]:
        """One write per wake-up: the text deltas that came, then the closing events."""
        text, keep = "", continues(self.t)  # keep: the answer continues a message (no "Assistant:" gap)
        async for batch in streaming.batches(self.t, 0, ping=None):
            chunks = []
            for e in batch:
                if isinstance(e, dict) and "data" in e and not streaming.is_last(e):
                    delta = e["data"] if text or keep else e["data"].lstrip()  # the answer starts after "Assistant:"
                    if delta:
                        text += delta
                        chunks.append(self._ev("response.output_text.delta", **self._loc, delta=delta, logprobs=[]))
            if chunks:
                yield b"".join(chunks)
        self._ended = True  # before the last write: a client that leaves now has it all
        yield self._closing(text)

    def _closing(self, text: str) -> bytes:
        ev, loc, final = self._ev, self._loc, response(self.t, self.model)
        return (
            ev("response.output_text.done", **loc, text=text, logprobs=[])
            + ev("response.content_part.done", **loc, part={**self._part, "text": text})
            + ev("response.output_item.done", output_index=0, item=message(self.t, text))
            + ev(_LAST.get(final["status"], "response.incomplete"), response=final)
        )

    def listen(self, fn: Callable[[], None] | None) -> None:
        pass  # (direct mode only)

    def abort(self) -> None:
        if self.on_abort is not None and not self._ended:
            on_abort, self.on_abort = self.on_abort, None  # once
            on_abort()

    def close(self) -> None:
        self.abort()
