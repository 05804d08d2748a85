"""A response in a conversation (`conversation` on /v1/responses; the conversation routes:
conversation_routes.py; the rows: server.tasks.conversations).

The prompt is the conversation's items, then the input. Where the conversation has a head (the
last response whose state holds its items up to head_seq, nothing deleted since) the response
forks the head's task and renders only the items after head_seq: the history is never prefilled
again, as with previous_response_id. Without one (no response yet, an item deleted, the head's
response deleted or continued elsewhere) the whole history is rendered as a stateless input.

A response's input and output items join the conversation once it ended completed or incomplete
(max_output_tokens): a cancelled or failed one adds nothing, so a client that sends it again
finds the conversation as it was. The join (`settle`) runs when the response's run ends
(`join_when_done`), and again wherever the conversation is read (every conversation route and
every response in it settles first) or one of its responses deleted: a join the server did not
get to (a restart) is done then, from the stored task and the run's row.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from server.api.errors import ApiError, task_error
from server.api.responses import render
from server.api.responses.items import Item, Rendered, render_input
from server.api.responses.schemas import InputItem, InputMessage, ResponseInput
from server.tasks.conversations import (
    MAX_ITEMS,
    Conversation,
    ConversationFull,
    ConversationNotFound,
    ItemIdTaken,
    ItemNotFound,
)
from server.tasks.errors import TaskError, TaskNotFound

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

log = logging.getLogger("server.api.responses")
JOINS = ("completed", "incomplete")
"""The statuses of a response whose items join its conversation."""

_ITEM: TypeAdapter[Item] = TypeAdapter(InputItem)
T = TypeVar("T")
_AT = re.compile(r"input\[(\d+)\](.*)")


def conversation_id(body: ResponseInput) -> str | None:
    """The id the `conversation` field names (a string, or {"id": ...})."""
    c = body.conversation
    if c is None:
        return None
    cid = c.get("id") if isinstance(c, dict) else c
    if not isinstance(cid, str) or not cid:
        raise ApiError(400, "conversation must be a conversation id or {\"id\": <conversation id>}",
                       param="conversation", code="invalid_request")  # fmt: skip
    return cid


def not_found(cid: str, param: str | None) -> ApiError:
    return ApiError(404, f"conversation {cid!r} not found (unknown, deleted, or another API key's)", param=param,
                    code="conversation_not_found")  # fmt: skip


async def db(aw: Awaitable[T], cid: str, param: str | None = "conversation_id", after: bool = False) -> T:
    """Await a conversation query: its refusals as ApiErrors (a missing item: 404, or with `after`
    the 400 of a list's cursor), a database outage as the task layer's (503)."""
    try:
        return await aw
    except ConversationNotFound:
        raise not_found(cid, param) from None
    except ItemNotFound as exc:
        if after:
            raise ApiError(400, f"after {exc.args[0]!r} is not the id of an item of this list", param="after",
                           code="invalid_request") from None  # fmt: skip
        raise ApiError(404, f"item {exc.args[0]!r} not found in conversation {cid!r}", param="item_id",
                       code="item_not_found") from None  # fmt: skip
    except ItemIdTaken as exc:
        raise ApiError(400, f"{exc}: give each item a new id, or none", param=f"items[{exc.index}].id",
                       code="invalid_request") from None  # fmt: skip
    except ConversationFull:
        raise ApiError(400, f"conversation {cid!r} would hold more than {MAX_ITEMS} items", param="items",
                       code="invalid_request") from None  # fmt: skip
    except TaskError as exc:
        raise task_error(exc) from None


async def settle(tm: TaskManager, cid: str, owner: str | None, param: str | None = "conversation_id") -> Conversation:
    """The conversation once the responses made in it that have ended joined it (404: not found)."""
    store, oid = tm.conversations, tm.owner_id(owner)
    await db(store.get(cid, oid), cid, param)  # (the owner's: runs of another's are not touched)
    runs = await db(store.runs(cid), cid, param)
    for run in runs:
        try:
            t = await tm.get(run.task_id, owner)
        except TaskNotFound:  # deleted: nothing joins
            await db(store.finish_run(cid, run, None), cid, param)
            continue
        except TaskError as exc:
            raise task_error(exc) from None
        if t.running:
            continue
        joined = _joined(t) if render.status(t) in JOINS else None
        await db(store.finish_run(cid, run, joined, len(t.tokens)), cid, param)
    # read again either way: a join running beside this one may have committed since the first read
    return await db(store.get(cid, oid), cid, param)


_joining: set[asyncio.Task[None]] = set()  # (referenced until done: the loop keeps weak references)


def join_when_done(tm: TaskManager, cid: str, owner: str | None, t: Task) -> None:
    """Settle the conversation once t's run ended (in the background: its answer is not held)."""

    async def join() -> None:
        if t.done is not None:
            await t.done.wait()
        try:
            await settle(tm, cid, owner)
        except ApiError as exc:  # deleted meanwhile, or the database away: the next reader settles it
            log.info("response %s: its items did not join conversation %s now (%s)", t.id, cid, exc.message)

    job = asyncio.create_task(join())
    _joining.add(job)
    job.add_done_callback(_joining.discard)


def _joined(t: Task) -> list[dict[str, Any]]:
    """A response's items as they join its conversation: its input, then its output."""
    return [*(render.meta(t).get("input") or []), *render.output(t)]


@dataclass
class Start:
    """Where a response in a conversation starts."""

    conv: Conversation
    head: Task | None
    """The task to fork (None: a new task from the zero state)."""
    items: list[Item] = field(default_factory=list)
    """The conversation's items the prompt renders before the input (those after the head's)."""


async def start(tm: TaskManager, body: ResponseInput, owner: str | None) -> Start | None:
    """The conversation of the request settled, its head and the items to render (None: the
    request names none). 400 for an input item whose id one of the conversation's has."""
    cid = conversation_id(body)
    if cid is None:
        return None
    c = await settle(tm, cid, owner, "conversation")
    head = await _head(tm, c, owner)
    since = c.head_seq if head is not None else 0
    store, oid = tm.conversations, tm.owner_id(owner)
    rows, _ = await db(store.items(cid, oid, since_seq=since, until_seq=c.last_seq), cid, "conversation")
    if isinstance(body.input, list):
        ids = [it.id for it in body.input if it.id is not None]
        taken = await db(store.taken(cid, ids), cid, "conversation")
        for i, it in enumerate(body.input):
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
    extra = [InputMessage(role="user", content=inp)] if isinstance(inp, str) else list(inp)
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
