"""Response bodies and streams of OpenAI requests that use tools or logprobs (render.py keeps
the plain requests' pre-encoded fast path): chat `message.tool_calls` / `delta.tool_calls`,
finish_reason "tool_calls", chat `logprobs.content` and the legacy completions' `logprobs`
({tokens, token_logprobs, top_logprobs, text_offset}), echoed prompts scored too."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from server.api.generation.jobs import Job
from server.api.generation.stream import Renderer
from server.api.openai.render import Meta, _chunker, _echo, _ender, _finish, _raise_failed, head, message, response
from server.api.openai.tools import MARKER, ToolPlan, content_end, split
from server.engine.types import Event, TokenLogprob


class TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


@dataclass(frozen=True)
class Extras:
    """What a request asked for beyond text."""

    tokenizer: TokenBytes
    tool_plan: ToolPlan | None = None
    logprobs: int | None = None
    """Chat: top_logprobs (when logprobs is true); completions: logprobs. None: off."""
    prompts: Sequence[Sequence[int]] = field(default_factory=list)
    """Completions with echo and logprobs: each job's prompt ids (scored too)."""

    def text(self, token: int) -> str:
        return self.tokenizer.token_bytes(token).decode("utf-8", "replace")


# --- chat ----------------------------------------------------------------------------------------


def _entry(ex: Extras, token: int, lp: float) -> dict[str, Any]:
    return {"token": ex.text(token), "logprob": lp, "bytes": list(ex.tokenizer.token_bytes(token))}


def chat_logprobs(ex: Extras, lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    return [{**_entry(ex, v.token, v.logprob), "top_logprobs": [_entry(ex, t, lp) for t, lp in v.top]} for v in lps]


def _message(job: Job, ex: Extras, meta: Meta) -> tuple[dict[str, Any], str | None]:
    raw = "".join(job.text)
    plan = ex.tool_plan
    content, calls = split(raw, plan.mode) if plan is not None else (raw, None)
    msg = message(meta.lead(content))
    if calls is None and plan is not None and plan.mode == "formatted" and _calls_begun(raw):
        msg["content"] = None  # a call list max_tokens cut, beside a JSON format: its text is no JSON,
        return msg, _finish(job)  # and the SDKs read a formatted reply's content as JSON as it streams
    if calls is None:
        return msg, _finish(job)
    msg.update(content=(content.strip() and meta.lead(content)) or None, tool_calls=calls)
    return msg, "tool_calls"


def _calls_begun(raw: str) -> bool:
    """The text began the call marker (the cut may fall inside the marker itself: `<tool_`)."""
    text = raw.lstrip()
    return text.startswith(MARKER) or (bool(text) and MARKER.startswith(text))


def chat_response(ex: Extras) -> Callable[[list[Job], Meta], dict[str, Any]]:
    def full(jobs: list[Job], meta: Meta) -> dict[str, Any]:
        _raise_failed(jobs)
        choices = []
        for j in jobs:
            msg, finish = _message(j, ex, meta)
            lp = None if ex.logprobs is None else {"content": chat_logprobs(ex, j.logprobs or []), "refusal": None}
            choices.append({"index": j.index, "message": msg, "logprobs": lp, "finish_reason": finish})
        return response(meta, "chat.completion", choices, jobs)

    return full


@dataclass
class _ChatState:
    sent: int = 0  # characters of content streamed
    lps: list[TokenLogprob] = field(default_factory=list)  # logprobs not sent yet


def chat_renderer(ex: Extras) -> Callable[[list[Job], Meta, bool], Renderer]:
    def make(jobs: list[Job], meta: Meta, include_usage: bool) -> Renderer:
        base = head(meta, "chat.completion.chunk")
        chunk = _chunker(base, include_usage)
        states = {j.index: _ChatState() for j in jobs}
        plan = ex.tool_plan

        def choice(job: Job, delta: dict[str, Any], st: _ChatState, finish: str | None = None) -> dict[str, Any]:
            lp = None
            if ex.logprobs is not None and st.lps:
                lp, st.lps = {"content": chat_logprobs(ex, st.lps), "refusal": None}, []
            return {"index": job.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

        def content(job: Job, st: _ChatState, text: str) -> bytes:
            text = meta.lead(text)
            new, st.sent = text[st.sent :], max(st.sent, len(text))
            return chunk([choice(job, {"content": new}, st)]) if new else b""

        def render(job: Job, batch: list[Event]) -> tuple[bytes, bool]:
            st = states[job.index]
            for ev in batch:
                st.lps.extend(ev.logprobs or ())
            raw = "".join(job.text)
            if job.finish_reason is None:
                if plan is None:
                    return content(job, st, raw), False
                return content(job, st, raw[: content_end(raw, plan.mode)]), False
            msg, finish = _message(job, ex, meta)
            out = content(job, st, msg["content"] or "")
            for i, call in enumerate(msg.get("tool_calls") or ()):
                fn = call["function"]
                head = {
                    "index": i,
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": ""},
                }
                out += chunk([choice(job, {"tool_calls": [head]}, st)])
                out += chunk(
                    [choice(job, {"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}, st)]
                )
            return out + chunk([choice(job, {}, st, finish)]), True

        # a forced call's answer has no content (null, as OpenAI's first delta of tool calls)
        first = {"role": "assistant", "content": None if plan is not None and plan.forced else ""}
        preamble = [chunk([choice(j, dict(first), states[j.index])]) for j in jobs]
        return Renderer(preamble, render, _ender(jobs, meta, include_usage, chunk))

    return make


# --- completions ---------------------------------------------------------------------------------


def _legacy(ex: Extras, values: Sequence[TokenLogprob | None], tokens: Sequence[int], at: _Offsets) -> dict[str, Any]:
    """{tokens, token_logprobs, top_logprobs, text_offset}; a None value: a token without one.
    `top_logprobs` holds the chosen token too (OpenAI's: up to logprobs + 1 entries)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, v in zip(tokens, values, strict=True):
        text = ex.text(tok)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if v is None else v.logprob)
        out["top_logprobs"].append(None if v is None else {**{ex.text(t): lp for t, lp in v.top}, text: v.logprob})
        out["text_offset"].append(at.place(ex.tokenizer.token_bytes(tok)))
    return out


@dataclass
class _Offsets:
    """Where each token's text begins in a text (`text_offset` counts characters): one character
    can span several tokens (each token's own text is then U+FFFD), so the bytes are decoded as
    they come, and bytes a character still waits for are held. Held bytes that the next token
    does not go on with end as one U+FFFD before it (the decoder's "replace")."""

    count: int = 0
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def place(self, data: bytes) -> int:
        """The index at which `data`'s text begins; then its characters are counted."""
        start = self.count
        held = self.decoder.getstate()[0]
        if held and data and not _goes_on(held, data[0]):
            start += 1
        self.count += len(self.decoder.decode(data))
        return start


def _goes_on(held: bytes, byte: int) -> bool:
    """Whether `byte` continues the character `held` began (a valid UTF-8 prefix, or whole)."""
    try:
        (held + bytes([byte])).decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.reason == "unexpected end of data"
    return True


def _echoed(ex: Extras, job: Job) -> tuple[list[TokenLogprob | None], list[int]]:
    """The scored prompt of an echo: its logprobs and ids. The engine scores every fed token but
    the first; the prompt's first token is scored too where a `state`'s pending tokens came
    before it (its logprob None only when it is the first token fed)."""
    if job.index >= len(ex.prompts):
        return [], []
    ids = list(ex.prompts[job.index])
    fed = list(job.prompt_logprobs or [])  # (the base's pending tokens', then the prompt's)
    k = min(len(ids), len(fed))
    return [None] * (len(ids) - k) + fed[len(fed) - k :], ids


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: a[k] + b[k] for k in a}


def completion_response(ex: Extras) -> Callable[[list[Job], Meta], dict[str, Any]]:
    def full(jobs: list[Job], meta: Meta) -> dict[str, Any]:
        _raise_failed(jobs)
        choices = []
        for j in jobs:
            echo = _echo(meta, j)
            pv, pids = _echoed(ex, j)
            lps = j.logprobs or []
            lp = _merge(
                _legacy(ex, pv, pids, _Offsets()), _legacy(ex, lps, [v.token for v in lps], _Offsets(len(echo)))
            )
            choices.append(
                {"index": j.index, "text": echo + "".join(j.text), "logprobs": lp, "finish_reason": _finish(j)}
            )
        return response(meta, "text_completion", choices, jobs)

    return full


def completion_renderer(ex: Extras) -> Callable[[list[Job], Meta, bool], Renderer]:
    """Each batch is one chunk with its tokens' logprobs; an echo (text and scored prompt) comes
    with the first, where the prompt's logprobs are known."""

    def make(jobs: list[Job], meta: Meta, include_usage: bool) -> Renderer:
        base = head(meta, "text_completion")
        chunk = _chunker(base, include_usage)
        offsets: dict[int, _Offsets] = {}  # each choice's output, across its chunks

        def render(job: Job, batch: list[Event]) -> tuple[bytes, bool]:
            text = "".join(ev.text for ev in batch)
            lps = [v for ev in batch for v in ev.logprobs or ()]
            if job.index not in offsets:
                echo = _echo(meta, job)
                pv, pids = _echoed(ex, job)
                offsets[job.index] = _Offsets(len(echo))
                lp = _merge(
                    _legacy(ex, pv, pids, _Offsets()), _legacy(ex, lps, [v.token for v in lps], offsets[job.index])
                )
                text = echo + text
            else:
                lp = _legacy(ex, lps, [v.token for v in lps], offsets[job.index])
            done = job.finish_reason is not None
            finish = _finish(job) if done else None
            choice = {"index": job.index, "text": text, "logprobs": lp, "finish_reason": finish}
            return chunk([choice]), done

        return Renderer([], render, _ender(jobs, meta, include_usage, chunk))

    return make
