"""rwkv_lightning's state sessions: /state/chat/completions, /multi_state/chat/completions,
/state/status, /state/delete, on persistent tasks (server.api.lightning.sessions)."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.errors import ApiError, prompt_too_long, task_call
from server.api.generation.jobs import ClientGone
from server.api.lightning import docs
from server.api.lightning.auth import CredentialFirst, authorize
from server.api.lightning.errors import LightningError
from server.api.lightning.schemas import (
    OUR_NAMES,
    Credential,
    DeleteBody,
    MultiStateBody,
    StateBody,
    capped,
    sampling_params,
)
from server.api.lightning.session_stream import SessionStream, deleted_error, settle, stopper
from server.api.lightning.sessions import NameTooLong, SessionNotFound, Sessions, name_problem
from server.api.services import Services, get_services, json_response, task_manager
from server.api.streaming.source import event
from server.api.streaming.sse import SSEResponse
from server.engine.types import MAX_STOP_STRINGS, PromptTooLongError

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

router = APIRouter(tags=["rwkv_lightning"], route_class=CredentialFirst)  # the key before the body
FINISH = {"stop": "stop", "length": "length", "stopped": "stop", "interrupted": "stop"}
LIGHTNING_NAMES = {"prompt": "contents", **OUR_NAMES}
"""Our task parameters' names -> the lightning fields they came from."""
T = TypeVar("T")


async def _tasks(aw: Awaitable[T], session: str | None = None, busy: str | None = None) -> T:
    """A session operation of the task layer, its errors as docs/lightning.md promises: a bad
    value is a 400 naming lightning's field (the task API answers 422 `invalid_task_request`,
    lightning's routes 400 `invalid_request`, as for any bad field); the rest keep their status
    and code (404, 409, 413, 429, 503), a 413 worded as the batch routes' and a running session
    (409) named by its `session_id` (or `busy`, the message of a call that only reads the running
    task), not by the task under it."""
    try:
        return await task_call(_contents_named(aw))
    except ApiError as exc:
        exc.param = LIGHTNING_NAMES.get(exc.param or "", exc.param)
        if exc.status == 409 and exc.code == "task_conflict" and session is not None:
            one_writer = f"session {session!r} is busy: one call at a time writes to a session; retry once it ends"
            exc.message = busy or one_writer
            exc.param = "session_id"
        if exc.status != 422:
            raise
        raise ApiError(400, exc.message, param=exc.param, code="invalid_request") from None


async def _contents_named(aw: Awaitable[T]) -> T:
    try:
        return await aw
    except PromptTooLongError as exc:
        raise prompt_too_long("contents", exc.tokens, exc.limit) from None


def _request(body: StateBody, sv: Services) -> tuple[str, str, dict[str, Any]]:
    """(session_id, the prompt, the sampling fields by our names), checked: lightning's 400s
    for a missing session_id or not exactly one prompt, ours for a bad field."""
    sid = body.session_id
    if not sid:
        raise LightningError(400, "Missing session_id parameter")
    problem = name_problem(sid)
    if problem is not None:
        raise LightningError(400, problem)
    if len(body.contents) != 1 or not body.contents[0]:
        raise LightningError(400, "Request must be single prompt: 'contents' holds exactly one non-empty prompt")
    if len(body.stop_tokens) > MAX_STOP_STRINGS:
        raise ApiError(
            400,
            f"invalid 'stop_tokens': at most {MAX_STOP_STRINGS} stop strings",
            param="stop_tokens",
            code="invalid_request",
        )
    fields = capped(body.fields(), sv.settings.max_tokens_limit)
    sampling_params(fields, sv.shape.vocab_size)  # checked before anything starts
    return sid, body.contents[0], fields


async def _answer(
    request: Request, sv: Services, t: Task, owner: str | None, body: StateBody, answer_id: str, node: int | None = None
) -> Response:
    """The run's native SSE or JSON; `node`: the multi_state node it made (the JSON says
    `dialogue_idx`, the stream sends its node event before [DONE])."""
    tm = task_manager(sv)
    sessions = Sessions.of(tm)
    named = {"dialogue_idx": node} if node is not None else {}
    name = f"{body.session_id}:{node}" if node is not None else str(body.session_id)
    if body.stream:
        tail = event({"object": "multi_state.dialogue_idx", "session_id": name, **named}) if node is not None else b""
        source = SessionStream(
            t, body.chunk_size, tail, stopper(request, tm, t), name=name, deleted=lambda: sessions.deleted(t)
        )
        return SSEResponse(source, metrics=sv.metrics, error_end=source.error_end)
    out = t.out  # this run's output (bound before the wait: a later call makes a new one)
    if not await settle(request, tm, t, owner):
        raise ClientGone()  # (answered 499, counted as an abort)
    if out.error or out.finish_reason == "error":
        raise ApiError(500, f"generation failed: {out.error or 'unknown error'}", code="generation_failed")
    if out.finish_reason == "stopped" and sessions.deleted(t):  # cut by /state/delete: not a whole answer
        raise deleted_error(name, len(out))
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": out.text},
        "finish_reason": FINISH.get(out.finish_reason or "", "stop"),
    }
    return json_response(
        {"id": answer_id, "object": "chat.completion", "model": body.model, "choices": [choice], **named}
    )


@router.post("/state/chat/completions", responses=docs.SESSION)
async def state_chat(body: StateBody, request: Request) -> Response:
    """One prompt; the session's state goes on from its last call (created on the first)."""
    owner = authorize(request, body.password)
    sv = get_services(request)
    sid, prompt, fields = _request(body, sv)
    t = await _tasks(Sessions.of(task_manager(sv)).chat(owner, sid, prompt, fields), session=sid)
    return await _answer(request, sv, t, owner, body, "rwkv7-batch")


@router.post("/multi_state/chat/completions", responses=docs.SESSION)
async def multi_state_chat(body: MultiStateBody, request: Request) -> Response:
    """One prompt from node `dialogue_idx` (0 or null: a new root); the answer names the new node."""
    owner = authorize(request, body.password)
    if "dialogue_idx" not in body.model_fields_set:  # lightning: only a missing key (null is 0)
        raise LightningError(400, "Missing dialogue_idx parameter")
    idx = body.dialogue_idx or 0
    sv = get_services(request)
    sid, prompt, fields = _request(body, sv)
    if idx < 0:  # never a node's number (lightning looks it up, and finds nothing)
        raise LightningError(404, f"State not found for dialogue_idx={idx}")
    try:
        busy = f"node {sid}:{idx} is generating: a branch starts from its state once that call ends; retry then"
        branch = Sessions.of(task_manager(sv)).branch(owner, sid, idx, prompt, fields)
        t, new = await _tasks(branch, session=sid, busy=busy)
    except SessionNotFound as exc:
        raise LightningError(404, str(exc)) from None
    except NameTooLong as exc:
        raise LightningError(400, str(exc)) from None
    return await _answer(request, sv, t, owner, body, "rwkv7-multi-state", node=new)


def _level(tm: TaskManager, t: Task) -> str:
    """Where the session's state is: in a slot on the device while it runs, in the task layer's
    state cache in memory, or only in the database."""
    if t.running:
        return "L1 (VRAM)"
    return "L2 (RAM)" if t.state_id and t.state_id in tm.cache else "Database (Disk)"


@router.post("/state/status", responses=docs.responses(400, 401, 503, ok=("json",)))
async def state_status(request: Request, body: Credential | None = None) -> Response:
    """The caller's sessions and dialogue nodes, by where their state is now."""
    owner = authorize(request, body.password if body is not None else None)
    tm = task_manager(get_services(request))
    sessions: list[dict[str, Any]] = []
    levels: list[str] = []
    for name, t in await _tasks(Sessions.of(tm).listing(owner)):
        level = _level(tm, t)
        stored = level.startswith("Database")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t.updated_at)) if stored else "In Memory"
        sessions.append({"session_id": name, "cache_level": level, "last_updated": when, "timestamp": t.updated_at})
        levels.append(level.split(" ")[0])
    counts = {lv: levels.count(lv) for lv in ("L1", "L2", "Database")}
    return json_response(
        {
            "status": "success",
            "total_sessions": len(sessions),
            "l1_cache_count": counts["L1"],
            "l2_cache_count": counts["L2"],
            "database_count": counts["Database"],
            "sessions": sessions,
        }
    )


@router.post("/state/delete", responses=docs.responses(400, 401, 404, 409, 503, ok=("json",)))
async def state_delete(body: DeleteBody, request: Request) -> Response:
    """Delete a session (or node) of the caller's; `delete_prefix` also every `<session_id>:*`."""
    owner = authorize(request, body.password)
    if not body.session_id:
        raise LightningError(400, "Missing session_id parameter")
    tm = task_manager(get_services(request))
    prefix = bool(body.delete_prefix)
    found = await _tasks(Sessions.of(tm).delete(owner, body.session_id, prefix))
    if found or prefix:
        return json_response({"status": "success", "message": f"Session {body.session_id} deleted successfully"})
    request.state.error = f"session {body.session_id!r} not found"
    return json_response({"status": "not_found", "message": f"Session {body.session_id} not found"}, 404)
