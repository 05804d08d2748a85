"""A response's SSE events (`event: <type>` + `data: {..., "type", "sequence_number"}`) as a
StreamSource (server.api.streaming.source), sent by SSEResponse: that response watches the
client, and when it leaves before the last event the source's `abort` stops the run (a response
is tied to its request: docs/agents.md, "The Responses API"). Responses are chats, not the
throughput path: the stream runs on the event loop (no direct writes).

The events are a function of the task's output alone, never of how the reads were batched: each
output token's text is one piece (one `response.output_text.delta` where it shows text), so the
stream of a running response and the replay of a finished one (`GET /v1/responses/{id}?stream=true`)
number every event alike, and `starting_after` resumes either. While the run goes on, the last
token's text waits for the next token or the end (the run's final flush adds to it).

A response whose create compacted its history first (context_management) sends that compaction
item first (output_index 0: output_item.added, output_item.done). Without tools the message item
opens at once. With tools it opens when its text does (a forced
call has none; text that may be the start of the call marker is held back, as chat holds it), and
the calls come at the end, each as OpenAI sends one: output_item.added (empty arguments),
function_call_arguments.delta, function_call_arguments.done, output_item.done.

A stream ends with response.completed, response.incomplete or response.failed. When the server
shuts down under it, the run is interrupted and the stream ends as the response then reads
(response.failed, status failed: render._error); a stream that cannot end so (the run did not
settle in time, or the source failed) ends with an `error` event. Never `data: [DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any, Literal

import orjson

from server.api.openai.agent_render import TokenBytes
from server.api.openai.tools import content_end
from server.api.responses.logprobs import entries, logprobs_of, text_start, tokens_in
from server.api.responses.render import compacted, continues, head, message, response, tool_mode
from server.tasks.records import Task

_LAST = {"completed": "response.completed", "failed": "response.failed"}
"""The last event's type by the final status (any other: response.incomplete, also for a run
another request cancelled: OpenAI's stream has no event of its own for it)."""

SETTLE_S = 2.0
"""How long a stream the server's shutdown cut waits for its run to settle (the next engine step
and the final row's commit; the server's graceful stop allows 5 s)."""


class _Events:
    """Numbered SSE events (sequence_number counts from 0 over the whole stream); those numbered
    up to `after` (a resumed stream's starting_after) are counted, not sent."""

    def __init__(self, after: int | None = None) -> None:
        self.seq = 0
        self.after = -1 if after is None else after

    def __call__(self, kind: str, **data: Any) -> bytes:
        seq, self.seq = self.seq, self.seq + 1
        if seq <= self.after:
            return b""
        body = orjson.dumps({"type": kind, "sequence_number": seq, **data})
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


class ResponseStream:
    path = None  # no direct writes
    foreign_thread = False

    def __init__(
        self,
        t: Task,
        model: str,
        on_abort: Callable[[], None] | None,
        starting_after: int | None = None,
        on_shutdown: Callable[[], None] | None = None,
        tokenizer: TokenBytes | None = None,
    ) -> None:
        """on_abort(): stop the run (called once, when the stream stops before its last event;
        None: the stream does not own the run, e.g. a retrieve or a background response's).
        on_shutdown(): interrupt the run when the server shuts down, for a stream that does not
        own it (the shutdown ends it anyway, later: the stream could not end with it).
        starting_after: send only the events numbered after it. tokenizer: for the
        text's logprobs (when the request asked for them: server.api.responses.logprobs)."""
        self.t, self.model = t, model
        self._tokenizer = tokenizer if t.params.get("logprobs") is not None else None
        self.on_abort = on_abort
        self.on_shutdown = on_shutdown
        self.stops_work = on_abort is not None
        self._ended = False
        self._ev = _Events(starting_after)
        self._yielded = 0  # events numbered before this were handed to the response
        self._mode = tool_mode(t)  # None: no tools
        self._keep = continues(t)  # the answer continues a message: its leading whitespace is text
        self._started = False  # the first events were made
        self._pos = 0  # output tokens whose text was made into events
        self._raw = ""  # (with tools: the output so far, where the marker is looked for)
        self._sent = 0  # characters of the message text streamed (a prefix of the final text)
        self._at: int | None = None  # where the message text starts in the output's text
        self._lp_next = 0  # the first output token whose logprob was not sent
        self._open = False  # the message item was added
        self._part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._cut = compacted(t)  # (the compaction its create made: the first output item)
        self._loc = {"item_id": message(t)["id"], "output_index": len(self._cut), "content_index": 0}

    @property
    def preamble(self) -> list[bytes]:
        return []  # (the first events are rest()'s first chunk: error_end knows whether they went)

    @property
    def ended(self) -> bool:
        return self._ended

    def take(self) -> tuple[bytes, bool] | None:
        return None  # (direct mode only)

    async def rest(self) -> AsyncGenerator[bytes, None]:
        """One write per wake-up: the events of the tokens that came, then the closing events."""
        out = self._start()
        while not self.t.out.finished:
            if len(self.t.out) - 1 > self._pos:
                out += self._advance(len(self.t.out) - 1)  # (the last token's text may still grow)
            if out:
                self._yielded = self._ev.seq
                yield out
                out = b""
                continue  # (look again: news may have come while the write waited)
            await self.t.out.wait_change(None)
        self._ended = True  # before the last write: a client that leaves now has it all
        yield out + self._finish()

    def _start(self) -> bytes:
        """response.created, response.in_progress (and the message item without tools)."""
        if self._started:
            return b""
        self._started = True
        first = head(self.t, self.model)
        out = self._ev("response.created", response=first) + self._ev("response.in_progress", response=first)
        for item in self._cut:
            out += self._ev("response.output_item.added", output_index=0, item=item)
            out += self._ev("response.output_item.done", output_index=0, item=item)
        return out + (self._open_message() if self._mode is None else b"")

    def _advance(self, n: int) -> bytes:
        """The events of output tokens _pos..n-1, each token's text one piece."""
        out, chunks = self.t.out, []
        for i in range(self._pos, n):
            piece = out.text[out.char_at(i) : out.char_at(i + 1)]
            if piece:
                chunks.append(self._piece(piece))
        self._pos = max(self._pos, n)
        return b"".join(chunks)

    def _finish(self) -> bytes:
        """The finished output's last pieces (text with no token at all last), then the closing
        events."""
        out = self.t.out
        chunk = self._advance(len(out))
        tail = out.text[out.char_at(len(out)) :]
        return chunk + (self._piece(tail) if tail else b"") + self._closing()

    def _piece(self, data: str) -> bytes:
        if self._mode is None:
            return self._plain(data)
        if self._mode == "forced":
            return b""  # (the output is the call list: no message text while it runs)
        self._raw += data
        return self._text(self._visible(self._raw))

    def _plain(self, data: str) -> bytes:
        """A response without tools: the new text is the delta (the answer starts after
        "Assistant:": its leading whitespace is dropped, unless it continues a message)."""
        delta = data if self._sent or self._keep else data.lstrip()
        self._sent += len(delta)
        return self._delta(delta) if delta else b""

    def _delta(self, delta: str) -> bytes:
        """A text delta; its logprobs: those of the tokens of the message text so far not sent
        before."""
        lps: list[dict[str, Any]] = []
        if self._tokenizer is not None:
            if self._at is None:  # (the output has text past its lead by now: its lead is known)
                self._at = text_start(self.t.out.text, self._keep)
            tokens = tokens_in(self.t.out, self._at, self._at + self._sent)
            new = range(max(tokens.start, self._lp_next), tokens.stop)
            self._lp_next = max(self._lp_next, tokens.stop)
            lps = entries(self._tokenizer, logprobs_of(self.t.out, new))
        return self._ev("response.output_text.delta", **self._loc, delta=delta, logprobs=lps)

    def _visible(self, raw: str) -> str:
        """With tools: the message text that may be streamed now, which ends before the call
        marker or a possible start of it (a forced call: none; with text.format: all of a reply,
        none of an output that may be the envelope)."""
        text = raw if self._keep else raw.lstrip()
        return text[: content_end(text, self._mode or "auto")]

    def _open_message(self) -> bytes:
        self._open = True
        item = {**message(self.t, "", "in_progress"), "content": []}
        return self._ev("response.output_item.added", output_index=self._loc["output_index"], item=item) + self._ev(
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
            out += self._delta(delta)
        return out

    def _closing(self) -> bytes:
        final = response(self.t, self.model, tokenizer=self._tokenizer)
        out = b""
        for index, item in enumerate(final["output"]):
            if item["type"] != "compaction":  # (sent first)
                out += self._message_done(item) if item["type"] == "message" else self._call(index, item)
        return out + self._ev(_LAST.get(final["status"], "response.incomplete"), response=final)

    def _message_done(self, item: dict[str, Any]) -> bytes:
        part = item["content"][0]
        text = part["text"]
        out = (b"" if self._open else self._open_message()) + self._text(text)  # (what was held back)
        ev, loc = self._ev, self._loc
        return (
            out
            + ev("response.output_text.done", **loc, text=text, logprobs=part["logprobs"])
            + ev("response.content_part.done", **loc, part=part)
            + ev("response.output_item.done", output_index=loc["output_index"], item=item)
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

    async def error_end(self, why: Literal["shutdown", "internal"]) -> bytes:
        """The last events of a stream the server ended (SSEResponse's error_end). The server
        shuts down: the run this stream shows is interrupted (on_abort, or on_shutdown); once
        the run settled (within SETTLE_S) the stream goes on to its end as any other, which is
        then response.failed (the response as GET shows it: failed, its error saying how to
        resume it), or the end it reached first; else an `error` event (shutting_down). The
        source failed: the run is stopped, and an `error` event (internal_error) follows the
        events sent."""
        if why == "internal":
            self.abort()
            self._ev.seq = self._yielded  # (events made but never handed over)
            return self._error("internal_error", "internal error while streaming")
        self.abort()
        if self.on_shutdown is not None:
            self.on_shutdown()
        t = self.t
        if t.running and t.done is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(t.done.wait(), SETTLE_S)
        if t.running:
            return self._error("shutting_down", "the server is shutting down")
        self._ended = True
        return self._start() + self._finish()

    def _error(self, code: str, message: str) -> bytes:
        self._ended = True
        return self._ev("error", code=code, message=message, param=None)

    def listen(self, fn: Callable[[], None] | None) -> None:
        pass  # (direct mode only)

    def abort(self) -> None:
        if self.on_abort is not None and not self._ended:
            on_abort, self.on_abort = self.on_abort, None  # once
            on_abort()

    def close(self) -> None:
        self.abort()
