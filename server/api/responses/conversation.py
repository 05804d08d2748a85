"""A response in a conversation (`conversation` on /v1/responses; the conversation routes:
conversation_routes.py; the rows: server.tasks.conversations).

The prompt is the conversation's items, then the input. Where the conversation has a head (the
last response whose state holds its items up to head_seq, nothing deleted since) the response
forks the head's task and renders only the items after head_seq: the history is never prefilled
again, as with previous_response_id. Without one (no response yet, an item deleted, the head's
response deleted or continued elsewhere) the whole history is rendered as a stateless input.

How a response's items join the conversation: joins.py.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from server.api.errors import ApiError, task_error
from server.api.responses.items import Item, Rendered, render_input
from server.api.responses.joins import ELSEWHERE_WAIT_S, db, join_when_done, locked, settle_runs
from server.api.responses.schemas import InputItem, InputMessage, ResponseInput
from server.tasks.conversations import Conversation
from server.tasks.errors import TaskError, TaskNotFound

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

_ITEM: TypeAdapter[Item] = TypeAdapter(InputItem)


def bad_id(item_id: str) -> str | None:
    """Why an item id cannot be a conversation's (None: it can): the item's routes take it in
    their path (no '/', not empty or dots alone, which clients resolve as path segments), and
    the database stores it as given (no control character, no U+FFFF)."""
    if not item_id.strip("."):
        return "an item id of a conversation must not be empty or dots alone"
    if "/" in item_id:
        return "an item id of a conversation must not hold '/' (the item's routes take it in their path)"
    if any(ord(ch) < 0x20 or ch in "\x7f\uffff" for ch in item_id):
        return "an item id of a conversation must not hold control characters or U+FFFF"
    return None


_AT = re.compile(r"input\[(\d+)\](.*)")


def conversation_id(body: ResponseInput) -> str | None:
    """The id the `conversation` field names (a string, or {"id": ...})."""
    c = body.conversation
    if c is None:
        return None
    extra = sorted(set(c) - {"id"}) if isinstance(c, dict) else []
    if extra:
        raise ApiError(400, f"unknown field 'conversation.{extra[0]}'", param=f"conversation.{extra[0]}",
                       code="invalid_request")  # fmt: skip
    cid = c.get("id") if isinstance(c, dict) else c
    if not isinstance(cid, str) or not cid:
        raise ApiError(400, "conversation must be a conversation id or {\"id\": <conversation id>}",
                       param="conversation", code="invalid_request")  # fmt: skip
    return cid


@dataclass
class Start:
    """Where a response in a conversation starts."""

    conv: Conversation
    head: Task | None
    """The task to fork (None: a new task from the zero state)."""
    items: list[Item]
    """The conversation's items the prompt renders before the input (those after the head's)."""


async def start(tm: TaskManager, body: ResponseInput, owner: str | None, *, counting: bool = False) -> Start | None:
    """The conversation of the request settled, its head and the items to render (None: the
    request names none). 400 for an input item whose id one of the conversation's has, and
    (unless `counting`: a count runs nothing) 400 conversation_locked while a response runs on it
    (begin checks again, in the transaction that records the run)."""
    cid = conversation_id(body)
    if cid is None:
        return None
    inputs = body.input if isinstance(body.input, list) else []
    for i, it in enumerate(inputs):
        why = bad_id(it.id) if it.id is not None else None
        if why is not None:
            raise ApiError(400, why, param=f"input[{i}].id", code="invalid_request")
    c, running = await settle_runs(tm, cid, owner, "conversation", wait=0 if counting else ELSEWHERE_WAIT_S)
    if running and not counting:
        raise locked(cid, running[0].task_id)
    head = await _head(tm, c, owner)
    since = c.head_seq if head is not None else 0
    store, oid = tm.conversations, tm.owner_id(owner)
    rows, _ = await db(store.items(cid, oid, since_seq=since, until_seq=c.last_seq), cid, "conversation")
    taken = await db(store.taken(cid, [it.id for it in inputs if it.id is not None]), cid, "conversation")
    for i, it in enumerate(inputs):
        if it.id in taken:
            raise ApiError(400, f"the id {it.id!r} is an item's of conversation {cid!r}: give each input "
                           "item a new id, or none", param=f"input[{i}].id", code="invalid_request")  # fmt: skip
    return Start(c, head, [_item(r.body) for r in rows])


async def _head(tm: TaskManager, c: Conversation, owner: str | None) -> Task | None:
    """The conversation's head task, where its state still holds the items up to head_seq."""
    if c.head_task is None:
        return None
    try:
        t = await tm.get(c.head_task, owner)
    except TaskNotFound:  # its response was deleted
        await db(tm.conversations.drop_head(c.id, c.head_task), c.id, "conversation")
        return None
    except TaskError as exc:
        raise task_error(exc) from None
    if t.running or len(t.tokens) != c.head_tokens:  # continued or running through /v1/tasks since
        return None
    return t


def _item(body: dict[str, Any]) -> Item:
    """A stored item as the input item it renders as."""
    try:
        return _ITEM.validate_python(body)
    except ValidationError as exc:  # (stored items were validated when added: a bug)
        raise RuntimeError(f"a stored conversation item does not parse: {exc}") from None


def render_after(
    prior: Sequence[Item], inp: str | Sequence[Item], known: dict[str, str], owed: Sequence[str]
) -> Rendered:
    """The conversation's items `prior` then the input, rendered as one input (an assistant turn
    may span both; every call must be answered in either), its `items` the input's alone. An
    error names the input item (`input[i]...`), or the conversation for one of its items."""
    extra = [InputMessage(role="user", content=inp, id=None)] if isinstance(inp, str) else list(inp)
    n = len(prior)
    try:
        out = render_input([*prior, *extra], known, owed)
    except ApiError as exc:
        m = _AT.match(exc.param or "")
        if m is not None and int(m.group(1)) < n:
            exc.message = f"an item of the conversation ({prior[int(m.group(1))].id}): {exc.message}"
            exc.param = "conversation"
        elif m is not None:
            exc.param = f"input[{int(m.group(1)) - n}]{m.group(2)}"
        raise
    out.items = out.items[n:]
    return out


async def too_long(aw: Awaitable[Task], s: Start | None) -> Task:
    """The response's task made; a 413 of a whole history (a conversation with no head) names the
    conversation and says why it was prefilled whole, and what to do."""
    try:
        return await aw
    except ApiError as exc:
        if exc.status != 413 or s is None or s.head is not None or s.conv.last_seq == 0:
            raise
        exc.param = "conversation"
        exc.message = (f"conversation {s.conv.id!r}: its history and the input are over this server's prompt limit "
                       f"({exc.message}). With no response's state to start from (none yet, or the last one's "
                       "response or an item its state held was deleted), the whole history is prefilled: delete "
                       "items, or go on in a new conversation")  # fmt: skip
        raise


async def begin(tm: TaskManager, s: Start, t: Task, owner: str | None) -> None:
    """Record t's run on the conversation, and join its items when it ends (joins.py). When that
    cannot be recorded (the conversation deleted meanwhile: 404, the database away: 503) t is
    stopped and deleted: nothing of the request stays."""
    try:
        run = await db(tm.conversations.begin_run(s.conv, t.id, t.version, tm.instance), s.conv.id, "conversation")
    except ApiError:
        tm.abort(t)
        with contextlib.suppress(Exception):
            await tm.delete(t.id, owner)
        raise
    join_when_done(tm, s.conv.id, t, run)
