"""POST /v1/responses/compact, and the compaction items of a response's input (docs/agents.md,
"Compaction").

OpenAI's compaction shortens a long history into an opaque item that later requests send in its
place. An RWKV model holds a whole history in a state of fixed size, so a compaction here is that
state, kept: the route (compact.py) prefills the history it is given (the previous response's
state, then the instructions and the input; nothing is summarized, so nothing is lost) into a
stored task tagged `compaction <uuid>`, with no output, and answers OpenAI's `response.compaction` object: the
history's user messages, then one `compaction` item whose encrypted_content names that task
(`cmp_<hex>`, the task TASK_<hex>). A response whose input holds the item forks the task and
renders only the items after it (`resume`), as previous_response_id forks a response; the items
before it are what the state holds, and are not read again.

A compaction belongs to the API key that made it and stays until deleted through /v1/tasks
(its task id); a stored state shared with the response it forked costs no second copy.
"""

from __future__ import annotations

import re
import uuid
from typing import TYPE_CHECKING, Any

from server.api.errors import ApiError, task_error
from server.api.responses import render
from server.api.responses.items import compaction_item, last_compaction
from server.api.responses.schemas import HistoryInput
from server.tasks.errors import TaskError, TaskNotFound

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

COMPACTION = "compaction "
"""The start of a compaction's task's tag (Task.tag; the rest is a uuid: a tag other than a
response's names one task of its owner, server.tasks.schema)."""
MAX_CHAIN = 1_000
"""Responses read back for the user messages of a history compacted by previous_response_id."""
_ID = re.compile(r"cmp_([0-9a-f]{32})")


def compaction_id(t: Task) -> str:
    return "cmp_" + t.id.split("_", 1)[1]


def new_tag() -> str:
    return COMPACTION + uuid.uuid4().hex


def is_compaction(t: Task) -> bool:
    return (t.tag or "").startswith(COMPACTION)


async def resume(tm: TaskManager, body: HistoryInput, owner: str | None) -> Task | None:
    """The task of the input's last compaction item (None: it has none). A 400 naming the item
    for one that names no compaction of this key, or beside previous_response_id or a
    conversation (each says where the history starts)."""
    last = last_compaction(body.input)
    if last is None:
        return None
    i, item = last
    if body.previous_response_id is not None:
        raise ApiError(400, "a compaction item in input and previous_response_id both say where the history "
                       "starts: give one of them", param="previous_response_id", code="invalid_request")  # fmt: skip
    if getattr(body, "conversation", None) is not None:
        raise ApiError(400, "a compaction item in the input of a response in a conversation (the conversation's "
                       "last response holds its history)", param=f"input[{i}]", code="invalid_request")  # fmt: skip
    m = _ID.fullmatch(item.encrypted_content)
    try:
        t = await tm.get(f"TASK_{m.group(1)}", owner) if m else None
    except TaskNotFound:
        t = None
    except TaskError as exc:
        raise task_error(exc) from None
    if t is None or not is_compaction(t):
        raise ApiError(400, f"input[{i}] names no compaction of this server's (unknown, deleted, or another API "
                       "key's)", param=f"input[{i}].encrypted_content", code="invalid_request")  # fmt: skip
    return t


def users(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [it for it in items if it.get("type") == "message" and it.get("role") == "user"]


async def users_of(tm: TaskManager, t: Task | None, owner: str | None) -> list[dict[str, Any]]:
    """The user messages of the history t's state holds: a compaction's, or those of the inputs of
    the chain of responses t ends (up to MAX_CHAIN of them, back to a compaction or the first)."""
    parts: list[list[dict[str, Any]]] = []
    while t is not None and len(parts) < MAX_CHAIN:
        m = render.meta(t)
        if is_compaction(t):
            parts.append(list(m.get("users") or []))
            break
        parts.append(users(m.get("input") or []))
        t = await _parent(tm, t, owner)
    return [it for part in reversed(parts) for it in part]


async def _parent(tm: TaskManager, t: Task, owner: str | None) -> Task | None:
    """The response or compaction t forked (None: none, or deleted)."""
    if not t.parent_id:
        return None
    try:
        p = await tm.get(t.parent_id, owner)
    except TaskNotFound:
        return None
    except TaskError as exc:
        raise task_error(exc) from None
    return p if render.is_response(p) or is_compaction(p) else None


def compacted(t: Task) -> dict[str, Any]:
    """OpenAI's response.compaction object of t: the history's user messages, then its item."""
    cid = compaction_id(t)
    return {
        "id": cid,
        "object": "response.compaction",
        "created_at": int(t.created_at),
        "output": [*(render.meta(t).get("users") or []), compaction_item(cid)],
        "usage": render.usage(t),
    }
