"""/v1/conversations: OpenAI's Conversations API (the SDK's `client.conversations`, the Agents
SDK's OpenAIConversationsSession and `Runner.run(conversation_id=...)`).

A conversation is a list of items (messages, function calls and their outputs, in the Responses
input items' shapes) that a response given `conversation` renders before its input, and that its
input and output join once it ended (server.api.responses.conversation, which also keeps the
state of the conversation's last response: the next response starts from it; joins.py: how a
response's items join). Rows:
server.tasks.conversations. Every route settles the conversation first (the responses made in
it that have ended join it), so what it answers includes them.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.api.errors import ApiError
from server.api.openai.schemas import Metadata
from server.api.openai.tools import ToolError, arguments
from server.api.openapi import answers
from server.api.responses.conversation import bad_id
from server.api.responses.items import stored_item
from server.api.responses.joins import db, settle
from server.api.responses.schemas import FunctionCall, InputItem
from server.api.sampling import bad_text
from server.api.services import get_owner, get_services, json_response, task_manager
from server.tasks.conversations import Conversation, StoredItem

router = APIRouter(prefix="/v1", tags=["conversations"])

MAX_ADD = 20
"""Items one request may add (OpenAI's bound)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    error_status: ClassVar[int] = 400


class ConversationCreate(_Body):
    items: list[InputItem] | None = Field(None, max_length=MAX_ADD)
    metadata: Metadata = None
    safety_identifier: str | None = None  # ignored: no abuse monitoring here


class ConversationUpdate(_Body):
    metadata: Metadata
    """Required (null clears it)."""

    @field_validator("metadata", mode="before")
    @classmethod
    def _null_clears(cls, v: Any) -> Any:
        return {} if v is None else v


class ItemsCreate(_Body):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ADD)


def _stored(items: list[Any] | None, body: BaseModel) -> list[dict[str, Any]]:
    """The items to add as stored (each with an id); 400 naming the field for text that is no
    valid Unicode, arguments that are not JSON text, or an id no conversation item may have (one
    given twice, or taken in the conversation: the store's ItemIdTaken)."""
    bad = bad_text(body)
    if bad is not None:
        raise ApiError(400, f"invalid '{bad[0]}': {bad[1]}", param=bad[0], code="invalid_request")
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items or ()):
        try:
            if isinstance(it, FunctionCall):
                arguments(it.arguments, f"items[{i}].arguments")
        except ToolError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_request") from None
        s = stored_item(it.model_dump(exclude_none=True), it.id)
        why = bad_id(s["id"])
        if why is not None:
            raise ApiError(400, why, param=f"items[{i}].id", code="invalid_request")
        out.append(s)
    return out


def _object(c: Conversation) -> dict[str, Any]:
    return {"id": c.id, "object": "conversation", "created_at": int(c.created_at), "metadata": c.metadata}


def _list(items: list[StoredItem], more: bool) -> dict[str, Any]:
    data = [it.body for it in items]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


@router.post("/conversations", responses=answers(400, 401, 503))
async def create_conversation(body: ConversationCreate, request: Request) -> Response:
    tm = task_manager(get_services(request))
    items = _stored(body.items, body)
    c = await db(tm.conversations.create(tm.owner_id(get_owner(request)), body.metadata or {}, items), "", None)
    return json_response(_object(c))


# GET or DELETE `/v1/conversations`: the id is missing (a 404 in the OpenAI shape, not a 405)
@router.api_route("/conversations", methods=["GET", "DELETE"], include_in_schema=False)
async def no_conversation_id(request: Request) -> Response:
    raise ApiError(404, f"no route {request.method} {request.url.path}: the conversation id is missing "
                   "(POST /v1/conversations creates one)", param="conversation_id", code="not_found")  # fmt: skip


@router.get("/conversations/{conversation_id}", responses=answers(401, 404, 503))
async def get_conversation(conversation_id: str, request: Request) -> Response:
    c = await settle(task_manager(get_services(request)), conversation_id, get_owner(request))
    return json_response(_object(c))


@router.post("/conversations/{conversation_id}", responses=answers(400, 401, 404, 503))
async def update_conversation(conversation_id: str, body: ConversationUpdate, request: Request) -> Response:
    tm, owner = task_manager(get_services(request)), get_owner(request)
    _stored(None, body)
    await settle(tm, conversation_id, owner)
    c = await db(tm.conversations.update(conversation_id, tm.owner_id(owner), body.metadata or {}), conversation_id)
    return json_response(_object(c))


@router.delete("/conversations/{conversation_id}", responses=answers(401, 404, 503))
async def delete_conversation(conversation_id: str, request: Request) -> Response:
    """The conversation and its items (the responses made in it stay)."""
    tm, owner = task_manager(get_services(request)), get_owner(request)
    await db(tm.conversations.delete(conversation_id, tm.owner_id(owner)), conversation_id)
    return json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


@router.post("/conversations/{conversation_id}/items", responses=answers(400, 401, 404, 503))
async def add_items(
    conversation_id: str, body: ItemsCreate, request: Request, include: Annotated[list[str] | None, Query()] = None
) -> Response:
    """Append items (after those of the responses that have ended); `include` is ignored."""
    tm, owner = task_manager(get_services(request)), get_owner(request)
    items = _stored(body.items, body)
    await settle(tm, conversation_id, owner)
    added = await db(tm.conversations.add(conversation_id, tm.owner_id(owner), items), conversation_id)
    return json_response(_list(added, False))


@router.get("/conversations/{conversation_id}/items", responses=answers(400, 401, 404, 503))
async def list_items(
    conversation_id: str,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    include: Annotated[list[str] | None, Query()] = None,
) -> Response:
    """A page of the items (`order` desc: the last first; `after`: an item id, the page after it;
    `include` is ignored: items carry no extra data here)."""
    tm, owner = task_manager(get_services(request)), get_owner(request)
    await settle(tm, conversation_id, owner)
    q = tm.conversations.items(conversation_id, tm.owner_id(owner), order=order, after=after, limit=limit)
    found, more = await db(q, conversation_id, after=True)
    return json_response(_list(found, more))


@router.get("/conversations/{conversation_id}/items/{item_id}", responses=answers(401, 404, 503))
async def get_item(
    conversation_id: str, item_id: str, request: Request, include: Annotated[list[str] | None, Query()] = None
) -> Response:
    tm, owner = task_manager(get_services(request)), get_owner(request)
    await settle(tm, conversation_id, owner)
    it = await db(tm.conversations.item(conversation_id, tm.owner_id(owner), item_id), conversation_id)
    return json_response(it.body)


@router.delete("/conversations/{conversation_id}/items/{item_id}", responses=answers(401, 404, 503))
async def delete_item(conversation_id: str, item_id: str, request: Request) -> Response:
    """Delete one item; answers the conversation (as OpenAI does)."""
    tm, owner = task_manager(get_services(request)), get_owner(request)
    await settle(tm, conversation_id, owner)
    c = await db(tm.conversations.delete_item(conversation_id, tm.owner_id(owner), item_id), conversation_id)
    return json_response(_object(c))
