"""rwkv_lightning's answers: the native JSON and SSE shapes of its batch routes, and the shapes
of its OpenAI-style chat route, as renderers of engine jobs
(server.api.generation.stream.ChoiceStream sends them, on the engine thread for one-prompt
streams).

Native JSON: {"id", "object", "model": <request label>, "choices": [{"index", "message":
{"role": "assistant", "content"}, "finish_reason"}]}, one choice per prompt, in prompt order.
Native SSE: per flush `{"object": "chat.completion.chunk", "choices": [{"index": i, "delta":
{"content": text}}]}` (no id, model or finish_reason), then `data: [DONE]`. A flush happens once
a prompt has `chunk_size` new tokens, and at its end (and, when the server shuts down under the
stream, before its `shutting_down` event: FlushingRenderer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from server.api.generation.jobs import Job
from server.api.generation.stream import Renderer
from server.api.openai.render import FINISH, Meta, usage
from server.api.streaming.source import DONE, event
from server.api.streaming.sse import chat_error_end
from server.engine.types import Event


def finish_reason(job: Job) -> str:
    return FINISH.get(job.finish_reason or "", job.finish_reason or "stop")


def text_of(job: Job) -> str:
    return "".join(job.text)


def native_response(jobs: list[Job], *, id: str, object: str, model: str, **extra: Any) -> dict[str, Any]:
    choices = [
        {"index": j.index, "message": {"role": "assistant", "content": text_of(j)}, "finish_reason": finish_reason(j)}
        for j in jobs
    ]
    return {"id": id, "object": object, "model": model, "choices": choices, **extra}


_HEAD = b'data: {"object":"chat.completion.chunk","choices":[{"index":'


def native_chunk(index: int, text: str) -> bytes:
    """The bytes of one native SSE event: `event({"object": "chat.completion.chunk", "choices":
    [{"index": index, "delta": {"content": text}}]})`, with one orjson call on the text."""
    return b'%s%d,"delta":{"content":%s}}]}\n\n' % (_HEAD, index, orjson.dumps(text))


class Flushes:
    """Each choice's text not yet sent, sent once `chunk_size` tokens came since its last flush
    (or at its end) and there is text to send: lightning's rule. Tokens whose text is held back
    (a split UTF-8 character, a possible stop string) send nothing and do not restart the count,
    so the text they held goes out with the next token that brings text."""

    def __init__(self, n: int, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.text = [""] * n
        self.sent_at = [0] * n  # completion tokens at the last flush

    def add(self, job: Job, batch: list[Event]) -> str | None:
        """The text to send now for this batch of the job's events (recorded already), or None."""
        i = job.index
        self.text[i] += batch[0].text if len(batch) == 1 else "".join(ev.text for ev in batch)
        due = job.finish_reason is not None or job.completion_tokens - self.sent_at[i] >= self.chunk_size
        if not (due and self.text[i]):
            return None
        out, self.text[i], self.sent_at[i] = self.text[i], "", job.completion_tokens
        return out

    def held(self) -> list[tuple[int, str]]:
        """(index, text) of every choice's text not sent yet, taken (each choice's comes in order
        after what it sent: the stream shows no gap)."""
        out = [(i, t) for i, t in enumerate(self.text) if t]
        for i, _ in out:
            self.text[i] = ""
        return out


@dataclass
class FlushingRenderer(Renderer):
    """A renderer whose text waits for its flush (`chunk_size` tokens): `held()` renders what it
    holds now, sent before the error event of a stream that ends early (the server shutting
    down under it): the client gets all the text read for it so far, whatever its chunk_size."""

    held: Callable[[], bytes] = lambda: b""

    async def error_end(self, why: Literal["shutdown", "internal"]) -> bytes:
        """SSEResponse's `error_end`: the held text, then the error event and [DONE]."""
        return self.held() + chat_error_end(why)


def native_renderer(jobs: list[Job], chunk_size: int, tail: bytes = b"") -> FlushingRenderer:
    """The native SSE stream of these jobs; `tail`: events sent just before [DONE]."""
    flushes = Flushes(len(jobs), chunk_size)

    def render(job: Job, batch: list[Event]) -> tuple[bytes, bool]:
        text = flushes.add(job, batch)
        return (native_chunk(job.index, text) if text else b""), job.finish_reason is not None

    return FlushingRenderer(
        [], render, lambda: tail + DONE, held=lambda: b"".join(native_chunk(i, t) for i, t in flushes.held())
    )


# --- the OpenAI-style route (/openai/v1/chat/completions) ---------------------------------------


def chat_style_response(job: Job, meta: Meta) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text_of(job)}, "finish_reason": finish_reason(job)}
        ],
        "usage": usage([job], meta),
    }


def chat_style_renderer(meta: Meta, chunk_size: int) -> FlushingRenderer:
    """Its stream: a role chunk, content chunks (one per flush), a finish chunk with an empty
    delta, [DONE]; every chunk `chat.completion.chunk` with one id/created/model, no usage."""
    base = {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model}
    flushes = Flushes(1, chunk_size)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return event({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    def render(job: Job, batch: list[Event]) -> tuple[bytes, bool]:
        text = flushes.add(job, batch)
        out = chunk({"content": text}) if text else b""
        if job.finish_reason is None:
            return out, False
        return out + chunk({}, finish_reason(job)), True

    return FlushingRenderer(
        [chunk({"role": "assistant"})],
        render,
        lambda: DONE,
        held=lambda: b"".join(chunk({"content": t}) for _, t in flushes.held()),
    )
