"""A stored response (a task) as the Responses API's object, and the SSE events of a streamed one.

Ids: the task `TASK_<hex>` (or `TMP_<hex>` with store: false) is the response `resp_<hex>`; its
message item is `msg_<hex>`. Usage: `input_tokens` = the whole history before the output (the
previous responses included, as OpenAI counts them), `cached_tokens` = those the starting state
had already consumed (not prefilled again), `output_tokens` = generated.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import orjson

from server.tasks import streaming
from server.tasks.records import Task

_ID = re.compile(r"^resp_([0-9a-f]{32})$")
STATUS = {
    "stop": "completed",
    "length": "incomplete",
    "stopped": "cancelled",
    "interrupted": "incomplete",
    "error": "failed",
}


def task_id(response_id: str) -> str | None:
    """The stored task of a response id (None: not a response id)."""
    m = _ID.match(response_id)
    return f"TASK_{m.group(1)}" if m else None


def response_id(t: Task) -> str:
    return "resp_" + t.id.split("_", 1)[1]


def _status(t: Task) -> str:
    return "in_progress" if t.running else STATUS.get(t.finish_reason or "", "failed")


def message(t: Task, text: str | None = None, status: str | None = None) -> dict[str, Any]:
    text = t.out.text.lstrip() if text is None else text
    return {
        "type": "message",
        "id": "msg_" + t.id.split("_", 1)[1],
        "status": status or ("in_progress" if t.running else "completed"),
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def usage(t: Task) -> dict[str, Any]:
    out = t.completion_tokens
    return {
        "input_tokens": t.out_start,
        "output_tokens": out,
        "total_tokens": t.out_start + out,
        "input_tokens_details": {"cached_tokens": max(0, t.out_start - t.prompt_tokens)},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


def response(t: Task, model: str, *, output: bool = True) -> dict[str, Any]:
    p = t.params
    fmt = p.get("response_format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        inner = fmt.get("json_schema", {})
        fmt = {"type": "json_schema", "name": inner.get("name"), "schema": inner.get("schema"), "strict": True}
    status = _status(t)
    parent = t.parent_id
    return {
        "id": response_id(t),
        "object": "response",
        "created_at": int(t.created_at),
        "status": status,
        "model": model,
        "output": [message(t)] if output else [],
        "previous_response_id": "resp_" + parent.split("_", 1)[1]
        if parent and parent[:4] in ("TASK", "TMP_")
        else None,
        "instructions": None,
        "max_output_tokens": p.get("max_tokens"),
        "temperature": p.get("temperature"),
        "top_p": p.get("top_p"),
        "text": {"format": fmt},
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "store": t.kind != "tmp",
        "metadata": {},
        "error": {"code": "server_error", "message": t.out.error or "generation failed"}
        if status == "failed"
        else None,
        "incomplete_details": {"reason": "max_output_tokens"}
        if t.finish_reason == "length"
        else {"reason": "interrupted"}
        if status == "incomplete"
        else None,
        "usage": None if t.running else usage(t),
    }


class _Events:
    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **data: Any) -> bytes:
        body = orjson.dumps({"type": kind, "sequence_number": self.seq, **data})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


async def events(t: Task, model: str) -> AsyncIterator[bytes]:
    """The SSE events of a response being generated, from its creation to its end."""
    ev = _Events()
    item = message(t, "", "in_progress")
    item["content"] = []
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    loc = {"item_id": item["id"], "output_index": 0, "content_index": 0}
    yield ev("response.created", response=response(t, model, output=False))
    yield ev("response.in_progress", response=response(t, model, output=False))
    yield ev("response.output_item.added", output_index=0, item=item)
    yield ev("response.content_part.added", **loc, part=part)
    text = ""
    async for batch in streaming.batches(t, 0, ping=None):
        for e in batch:
            if isinstance(e, dict) and "data" in e and not streaming.is_last(e):
                delta = e["data"] if text else e["data"].lstrip()
                if delta:
                    text += delta
                    yield ev("response.output_text.delta", **loc, delta=delta, logprobs=[])
    yield ev("response.output_text.done", **loc, text=text, logprobs=[])
    yield ev("response.content_part.done", **loc, part={**part, "text": text})
    yield ev("response.output_item.done", output_index=0, item=message(t, text))
    final = response(t, model)
    kind = {"completed": "response.completed", "failed": "response.failed"}.get(final["status"], "response.incomplete")
    yield ev(kind, response=final)
