"""A streamed response's SSE events (`event: <type>` + `data: {..., "type", "sequence_number"}`)
as a StreamSource (server.api.streaming.source), sent by SSEResponse: that response watches the
client, and when it leaves before the last event the source's `abort` stops the run (a response
is tied to its request: docs/agents.md, "The Responses API"). Responses are chats, not the
throughput path: the stream runs on the event loop (no direct writes).

Without tools the message item opens at once. With tools it opens when its text does (a forced
call has none; text that may be the start of the call marker is held back, as chat holds it), and
the calls come at the end, each as OpenAI sends one: output_item.added (empty arguments),
function_call_arguments.delta, function_call_arguments.done, output_item.done."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson

from server.api.openai.tools import content_end
from server.api.responses.render import continues, message, response, tool_mode
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
        self._mode = tool_mode(t)  # None: no tools
        self._keep = continues(t)  # the answer continues a message: its leading whitespace is text
        self._sent = 0  # characters of the message text streamed (a prefix of the final text)
        self._open = False  # the message item was added
        self._part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._loc = {"item_id": message(t)["id"], "output_index": 0, "content_index": 0}
        head = response(t, model, with_output=False)
        pre = self._ev("response.created", response=head) + self._ev("response.in_progress", response=head)
        self._preamble = [pre + (self._open_message() if self._mode is None else b"")]

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
        raw = ""  # (with tools: the output so far, where the marker is looked for)
        async for batch in streaming.batches(self.t, 0, ping=None):
            data = "".join(e["data"] for e in batch if isinstance(e, dict) and "data" in e and not streaming.is_last(e))
            if self._mode is None:
                out = self._plain(data)
            else:
                raw += data
                out = self._text(self._visible(raw))
            if out:
                yield out
        self._ended = True  # before the last write: a client that leaves now has it all
        yield self._closing()

    def _plain(self, data: str) -> bytes:
        """A response without tools: the new text is the delta (the answer starts after
        "Assistant:": its leading whitespace is dropped, unless it continues a message)."""
        delta = data if self._sent or self._keep else data.lstrip()
        self._sent += len(delta)
        return self._ev("response.output_text.delta", **self._loc, delta=delta, logprobs=[]) if delta else b""

    def _visible(self, raw: str) -> str:
        """With tools: the message text that may be streamed now, which ends before the call
        marker or a possible start of it (a forced call: none; with text.format: all of a reply,
        none of an output that may be the envelope)."""
        text = raw if self._keep else raw.lstrip()
        return text[: content_end(text, self._mode == "forced", self._mode == "formatted")]

    def _open_message(self) -> bytes:
        self._open = True
        item = {**message(self.t, "", "in_progress"), "content": []}
        return self._ev("response.output_item.added", output_index=0, item=item) + self._ev(
            "response.content_part.added", **self._loc, part=self._part
        )

    def _text(self, text: str) -> bytes:
        """The message text's delta (with tools the message opens once it has more than
        whitespace: a reply of calls only has no message)."""
        if not self._open and not text.strip():
            return b""
        out = b"" if self._open else self._open_message()
        delta, self._sent = text[self._sent :], len(text)
        if delta:
            out += self._ev("response.output_text.delta", **self._loc, delta=delta, logprobs=[])
        return out

    def _closing(self) -> bytes:
        final = response(self.t, self.model)
        out = b""
        for index, item in enumerate(final["output"]):
            out += self._message_done(item) if item["type"] == "message" else self._call(index, item)
        return out + self._ev(_LAST.get(final["status"], "response.incomplete"), response=final)

    def _message_done(self, item: dict[str, Any]) -> bytes:
        text = item["content"][0]["text"]
        out = (b"" if self._open else self._open_message()) + self._text(text)  # (what was held back)
        ev, loc = self._ev, self._loc
        return (
            out
            + ev("response.output_text.done", **loc, text=text, logprobs=[])
            + ev("response.content_part.done", **loc, part={**self._part, "text": text})
            + ev("response.output_item.done", output_index=0, item=item)
        )

    def _call(self, index: int, item: dict[str, Any]) -> bytes:
        ev, loc = self._ev, {"item_id": item["id"], "output_index": index}
        added = {**item, "arguments": "", "status": "in_progress"}
        return (
            ev("response.output_item.added", output_index=index, item=added)
            + ev("response.function_call_arguments.delta", **loc, delta=item["arguments"])
            + ev("response.function_call_arguments.done", **loc, arguments=item["arguments"])
            + ev("response.output_item.done", output_index=index, item=item)
        )

    def listen(self, fn: Callable[[], None] | None) -> None:
        pass  # (direct mode only)

    def abort(self) -> None:
        if self.on_abort is not None and not self._ended:
            on_abort, self.on_abort = self.on_abort, None  # once
            on_abort()

    def close(self) -> None:
        self.abort()
