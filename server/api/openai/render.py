"""OpenAI response bodies and the bytes of their SSE streams, for chat and completions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from server.api.errors import ApiError
from server.api.generation.jobs import Job
from server.api.generation.stream import Renderer
from server.api.streaming.source import DONE, event
from server.engine.types import Event

FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


@dataclass
class Meta:
    id: str
    model: str
    created: int
    prompt_tokens: int
    echoes: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    """Prompt tokens served from a kept state (usage.prompt_tokens_details.cached_tokens)."""
    continues: bool = False
    """Chat: the reply continues the last message, the assistant's (ChatPrompt.continues)."""

    def lead(self, text: str) -> str:
        """A chat reply's text from its start: without the whitespace the model writes after
        "Assistant:", but as written when it continues a message (the client joins the two)."""
        return text if self.continues else text.lstrip()


def usage(jobs: list[Job], meta: Meta) -> dict[str, Any]:
    completion = sum(j.completion_tokens for j in jobs)
    return {
        "prompt_tokens": meta.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": meta.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": meta.cached_tokens},
    }


def head(meta: Meta, obj: str) -> dict[str, Any]:
    """The fields every response and stream chunk of the OpenAI routes starts with."""
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model, "system_fingerprint": None}


def response(meta: Meta, obj: str, choices: list[dict[str, Any]], jobs: list[Job]) -> dict[str, Any]:
    """A whole (non-streamed) response: the head, its choices and the usage."""
    return {**head(meta, obj), "choices": choices, "usage": usage(jobs, meta)}


def _raise_failed(jobs: list[Job]) -> None:
    for j in jobs:
        if j.finish_reason == "error":
            raise ApiError(500, f"generation failed: {j.error or 'unknown error'}", code="generation_failed")


_MARK = "\x00text\x00"


class _Template:
    """Pre-encoded bytes of the one-choice text chunk, per choice index: the same bytes as
    `event({**base, "choices": [choice(index, text)], ["usage": None]})`, with one orjson call on
    the text only (the per-token cost of a stream)."""

    def __init__(self, base: dict[str, Any], include_usage: bool, choice: Callable[[int], dict[str, Any]]) -> None:
        self.base, self.include_usage, self.choice = base, include_usage, choice
        self.parts: dict[int, tuple[bytes, bytes]] = {}

    def __call__(self, index: int, text: str) -> bytes:
        parts = self.parts.get(index)
        if parts is None:
            body = {**self.base, "choices": [self.choice(index)]}
            if self.include_usage:
                body["usage"] = None
            head, _, tail = event(body).partition(orjson.dumps(_MARK))
            parts = self.parts[index] = (head, tail)
        return parts[0] + orjson.dumps(text) + parts[1]


def _chunker(base: dict[str, Any], include_usage: bool) -> Callable[..., bytes]:
    """chunk(choices, usage=None) -> one SSE event of this stream (usage key only when asked for)."""

    def chunk(choices: list[dict[str, Any]], use: Any = None) -> bytes:
        body = {**base, "choices": choices}
        if include_usage:
            body["usage"] = use
        return event(body)

    return chunk


def _ender(jobs: list[Job], meta: Meta, include_usage: bool, chunk: Callable[..., bytes]) -> Callable[[], bytes]:
    """end() -> the bytes that end a stream: the usage chunk (when asked for), then [DONE]."""
    return lambda: (chunk([], usage(jobs, meta)) if include_usage else b"") + DONE


def _finish(job: Job) -> str | None:
    return FINISH.get(job.finish_reason or "", job.finish_reason)


# --- chat ----------------------------------------------------------------------------------------


def message(content: str | None) -> dict[str, Any]:
    """A chat answer's message; `refusal` is null (no refusals here) but always there: OpenAI's
    schema requires it, and clients generated from that schema refuse a message without it."""
    return {"role": "assistant", "content": content, "refusal": None}


def chat_response(jobs: list[Job], meta: Meta) -> dict[str, Any]:
    _raise_failed(jobs)
    choices = [
        {
            "index": j.index,
            "message": message(meta.lead("".join(j.text))),
            "logprobs": None,
            "finish_reason": _finish(j),
        }
        for j in jobs
    ]
    return response(meta, "chat.completion", choices, jobs)


def chat_renderer(jobs: list[Job], meta: Meta, include_usage: bool) -> Renderer:
    """The pieces of a chat stream: the role chunks, render(job, batch), the end."""
    base = head(meta, "chat.completion.chunk")
    chunk = _chunker(base, include_usage)

    def choice(job: Job, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": job.index, "delta": delta, "logprobs": None, "finish_reason": finish}

    content = _Template(
        base,
        include_usage,
        lambda i: {"index": i, "delta": {"content": _MARK}, "logprobs": None, "finish_reason": None},
    )
    started: set[int] = set()  # choices whose leading whitespace is behind them (or kept)

    def render(job: Job, batch: list[Event]) -> tuple[bytes, bool]:
        text = batch[0].text if len(batch) == 1 else "".join(ev.text for ev in batch)
        if job.index not in started:
            text = meta.lead(text)
            if text:
                started.add(job.index)
        out = content(job.index, text) if text else b""
        if job.finish_reason is None:
            return out, False
        return out + chunk([choice(job, {}, _finish(job))]), True

    preamble = [chunk([choice(j, {"role": "assistant", "content": ""})]) for j in jobs]
    return Renderer(preamble, render, _ender(jobs, meta, include_usage, chunk))


# --- completions ---------------------------------------------------------------------------------


def completion_response(jobs: list[Job], meta: Meta) -> dict[str, Any]:
    _raise_failed(jobs)
    choices = [
        {"index": j.index, "text": _echo(meta, j) + "".join(j.text), "logprobs": None, "finish_reason": _finish(j)}
        for j in jobs
    ]
    return response(meta, "text_completion", choices, jobs)


def _echo(meta: Meta, job: Job) -> str:
    return meta.echoes[job.index] if job.index < len(meta.echoes) else ""


def completion_renderer(jobs: list[Job], meta: Meta, include_usage: bool) -> Renderer:
    """The pieces of a completions stream: the echo chunks, render(job, batch), the end."""
    base = head(meta, "text_completion")
    chunk = _chunker(base, include_usage)

    def choice(job: Job, text: str, finish: str | None = None) -> dict[str, Any]:
        return {"index": job.index, "text": text, "logprobs": None, "finish_reason": finish}

    content = _Template(
        base, include_usage, lambda i: {"index": i, "text": _MARK, "logprobs": None, "finish_reason": None}
    )

    def render(job: Job, batch: list[Event]) -> tuple[bytes, bool]:
        last = batch[-1]
        if len(batch) == 1:
            text = "" if last.finished else last.text
        else:
            text = "".join(ev.text for ev in (batch[:-1] if last.finished else batch))
        out = content(job.index, text) if text else b""
        if not last.finished:
            return out, False
        return out + chunk([choice(job, last.text, _finish(job))]), True

    preamble = [chunk([choice(j, _echo(meta, j))]) for j in jobs if _echo(meta, j)]
    return Renderer(preamble, render, _ender(jobs, meta, include_usage, chunk))
