"""A task's output as stream events, from any token position (attach to a running task or
replay a finished one). Readers work on the task's `Output` object, which holds every piece of
text with the token index it belongs to, so nothing is lost however fast the task runs: a
reader first replays what is there, then waits for more."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from server.tasks.output import Output
from server.tasks.records import Task, decode_rate

Event = dict[str, Any]
"""A stream event as its JSON object: the header, a text event ({"data", "pos", ...}), the final
event ({"finished": true, ...}) or an error event ({"error": {...}})."""


class _Keepalive(enum.Enum):
    KEEPALIVE = "keepalive"


KEEPALIVE: Literal[_Keepalive.KEEPALIVE] = _Keepalive.KEEPALIVE
"""Yielded after `ping` seconds without news (the route sends `: ping`): no event."""
Item = Event | Literal[_Keepalive.KEEPALIVE]


def header(t: Task) -> Event:
    """The stream's first event. prefill_time is the task's as it stands: 0 while the output's
    first token has not come (the final event has the figure then)."""
    return {"task_id": t.display_id, "prefill_time": round(t.prefill_time, 6)}


async def events(t: Task, pos: int = 0, *, ping: float | None = 15.0, out: Output | None = None) -> AsyncIterator[Item]:
    """Text events from token index `pos`, then the final event (or an error event).
    Each wake-up yields all the text that came since the last one (a slow reader gets it in
    fewer, larger events). `ping=None`: never yield KEEPALIVE (no timer per wait; the HTTP
    response pings idle streams itself)."""
    async for batch in batches(t, pos, ping=ping, out=out):
        for ev in batch:
            yield ev


async def batches(
    t: Task, pos: int = 0, *, ping: float | None = 15.0, out: Output | None = None, sent: int | None = None
) -> AsyncIterator[Sequence[Item]]:
    """events() as the list of what one wake-up has: [text event], [KEEPALIVE], and at the end
    [text event?, tail text event?, final or error event] (the last batch; `is_last` says so).
    `sent`: the characters of the text already sent (default: those before token `pos`)."""
    out = out if out is not None else t.out
    pos = max(0, min(int(pos), len(out)))
    sent = out.char_at(pos) if sent is None else sent
    batch: list[Event] = []
    while True:
        finished = out.finished
        n = len(out)
        if n > pos:
            batch, pos, sent = new_text(t, out, pos, n), n, out.char_at(n)
        if finished:
            break
        if batch:
            yield batch  # (the reader may hold it long: a slow client's flow control)
            batch = []
        if (len(out), out.finished) != (n, finished):
            continue  # it changed while the reader held the batch: that notify has passed
        await out.wait_change(ping)  # (a change from here on wakes it: no await before the wait)
        if ping is not None and (len(out), out.finished) == (n, finished):
            yield [KEEPALIVE]
    yield batch + closing_events(t, out, pos, sent)


def new_text(t: Task, out: Output, pos: int, n: int) -> list[Event]:
    """[the text event of output tokens pos..n] ([] when they brought no text)."""
    text = out.text[out.char_at(pos) : out.char_at(n)]
    return [text_event(t, text, n)] if text else []


def closing_events(t: Task, out: Output, pos: int, sent: int | None = None) -> list[Event]:
    """The end of a finished output read up to token `pos` (its last): the text that came with
    no token at all (a final flush), then the final event or the error event. `sent`: the
    characters the reader has sent (default: those before token `pos`). A flush is credited to
    the last token (Output.append), so a reader that had read that token before the flush came
    (a stop's last bytes of a character, or the text held back for a stop string) knows what it
    lacks only by its characters: by token it has read everything."""
    batch: list[Event] = []
    tail = out.text[out.char_at(pos) if sent is None else sent :]
    if tail:
        batch.append(text_event(t, tail, pos))
    if out.error:
        batch.append(
            {"error": {"message": out.error, "type": "server_error", "param": None, "code": "generation_failed"}}
        )
    else:
        batch.append(final_event(t, out))
    return batch


def is_last(ev: Item) -> bool:
    """The final event or the error event (the last of a stream)."""
    return isinstance(ev, dict) and ("finished" in ev or "error" in ev)


def text_event(t: Task, text: str, pos: int) -> Event:
    gen = t.generating()
    return {
        "data": text,
        "task_id": t.display_id,
        "gen_time": round(gen, 6),
        "speed": round(decode_rate(t.completion_tokens, gen), 3),
        "pos": pos,
    }


def final_event(t: Task, out: Output) -> Event:
    done = out is t.out
    completion = len(out)
    return {
        "task_id": t.display_id,
        "finished": True,
        "finish_reason": out.finish_reason if not done else t.finish_reason,
        "pos": completion,
        "prefill_time": round(t.prefill_time, 6),
        "gen_time": round(t.gen_time, 6),
        "speed": round(t.speed(), 3),
        "usage": {
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": t.prompt_tokens + completion,
        },
    }
