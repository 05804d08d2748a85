"""State routes: RWKV-7 state files in and out of the server (docs/states.md).

    POST   /v1/states/{name}       the file as the raw body -> read-only template `_name` (201)
    GET    /v1/states              the state templates this key may use (operator-loaded + its own)
    GET    /v1/states/{name}       one of them
    DELETE /v1/states/{name}       delete one (the operator's are read-only for API keys)
    GET    /v1/tasks/{id}/state    export a task's or template's state (?format=full|rwkv)

An upload is bounded by Settings.state_upload_bytes (refused by Content-Length before it is
read, and while it streams), read with weights_only, validated against the model and stored
only once valid: a bad file changes nothing. Errors use the OpenAI error shape; an invalid name
or file is 422, a taken name 409, a file too large 413, an unknown name 404.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from server.api.errors import ApiError, task_call, task_error
from server.api.loading import torch_dtype
from server.api.services import get_owner, get_services, json_response, task_manager
from server.tasks.errors import TaskError, TaskNotFound
from server.tasks.imports import (
    STATE_OPERATOR,
    STATE_UPLOAD,
    check_name,
    is_state_only,
    template_from_state,
)
from server.tasks.records import qualified

if TYPE_CHECKING:
    from server.tasks import Task, TaskManager

router = APIRouter(tags=["states"])
_WHY = {
    401: "missing or wrong API key",
    403: "another key's state",
    404: "no such state or task",
    409: "the name is taken, or the task is running",
    413: "the file is over state_upload_bytes",
    415: "a form instead of the raw file",
    422: "an invalid name or file",
    503: "loading, or stopped",
}
_ERROR = {"application/json": {"schema": {"type": "object", "properties": {"error": {"type": "object"}}}}}


def _answers(*codes: int, ok: int = 200, ok_content: dict[str, Any] | None = None) -> dict[int | str, Any]:
    """The OpenAPI responses of a route: its answer and its errors (the OpenAI error shape)."""
    out: dict[int | str, Any] = {code: {"description": _WHY[code], "content": _ERROR} for code in codes}
    if ok_content is not None:
        out[ok] = {"description": "OK", "content": ok_content}
    return out


_FILE = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
MAX_LISTED = 1000
MAX_PENDING_HEADER = 1024
"""Pending token ids listed in the export's X-RWKV-Pending-Tokens header (beyond: count only)."""


def _template_id(name: str, new: bool = False) -> str:
    try:
        return check_name(name, new)
    except TaskError as exc:
        raise ApiError(422, exc.message, param="name", code="invalid_state_name") from None


def _info(t: Task) -> dict[str, Any]:
    return {
        "name": t.display_id[1:],
        "template_id": t.display_id,
        "origin": _origin(t.parent_id),
        "pending_tokens": len(t.tokens) - t.state_pos,
        "created_at": t.created_at,
    }


def _origin(parent_id: str | None) -> str:
    return "operator" if parent_id == STATE_OPERATOR else "upload"


async def _state_template(tm: TaskManager, name: str, owner: str | None, *, write: bool = False) -> Task:
    tid = _template_id(name)
    try:
        t = await tm.get(tid, owner, write=write, force=True)
    except TaskNotFound:
        t = None
    except TaskError as exc:
        raise task_error(exc, param="name") from None
    if t is None or not is_state_only(t):
        raise ApiError(404, f"state {name!r} not found", param="name", code="state_not_found")
    return t


# --- upload / import ---------------------------------------------------------------------------
@router.post(
    "/v1/states/{name:path}",
    status_code=201,
    responses=_answers(401, 409, 413, 415, 422, 503),
    openapi_extra={"requestBody": {"required": True, "content": _FILE}},
)
async def upload_state(name: str, request: Request) -> Response:
    """Make the read-only template `_name` from the state file in the body (raw bytes:
    `curl --data-binary @state.pth`): a tuned state, or an export of this or another server."""
    sv = get_services(request)
    tm = task_manager(sv)
    tid = _template_id(name, new=True)
    if (request.headers.get("content-type") or "").lower().startswith("multipart/"):
        raise ApiError(
            415,
            "send the state file as the raw request body (curl --data-binary @state.pth "
            "-H 'Content-Type: application/octet-stream'), not as a form",
            code="unsupported_media_type",
            type="invalid_request_error",
        )
    if await task_call(_exists(tm, tid, get_owner(request))):  # before reading a large body (503: the database's)
        raise ApiError(
            409,
            f"template {tid!r} already exists; delete it first or pick another name",
            param="name",
            code="task_conflict",
        )
    data = await _read_body(request, sv.settings.state_upload_bytes)
    from server.model.state_file import StateFileError, read_state_file

    try:
        sf = await asyncio.to_thread(
            read_state_file,
            data,
            sv.shape,
            source=f"state file {name!r}",
            shift_dtype=torch_dtype(sv.settings.resolved_dtype()),
            wkv_dtype=torch_dtype(sv.settings.resolved_state_dtype()),
            max_pending=sv.settings.max_prompt_tokens,
        )
    except StateFileError as exc:
        raise ApiError(422, str(exc), param="file", code="invalid_state_file") from None
    tpl = await task_call(template_from_state(tm, name, sf.state, pending=sf.pending, owner=get_owner(request)))
    return json_response(
        {**_info(tpl), "format": "full" if sf.full else "rwkv", "dtype": sf.dtype, "bytes": len(data)}, status=201
    )


async def _exists(tm: TaskManager, tid: str, owner: str | None) -> bool:
    """The id an upload by this key would take is taken (its own `_name`; without keys the public one)."""
    oid = tm.owner_id(owner)
    t = await tm.access.find(qualified(tid, oid) or tid)
    return t is not None and not t.deleted


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) beyond `limit` bytes. The middleware refuses it first (by
    Content-Length, or while it streams: its raw-body limit for these routes is the same);
    this check keeps the route safe without it."""
    chunks, n = [], 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise ApiError(
                    413,
                    f"state file exceeds the limit of {limit} bytes (Settings.state_upload_bytes)",
                    param="file",
                    code="body_too_large",
                )
            chunks.append(chunk)
    except ClientDisconnect:  # the client left mid-upload: nothing is stored, and it is no server fault
        raise ApiError(
            422, f"the client disconnected after {n} bytes of the state file", param="file", code="invalid_state_file"
        ) from None
    if not n:
        raise ApiError(
            422, "empty body: send the state file as the raw request body", param="file", code="invalid_state_file"
        )
    return b"".join(chunks)


# --- list / info / delete ----------------------------------------------------------------------
@router.get("/v1/states", responses=_answers(401, 503))
async def list_states(request: Request) -> Response:
    tm = task_manager(get_services(request))
    owner = get_owner(request)
    everyone = await task_call(tm.list(None, kind="template", limit=MAX_LISTED))
    own = everyone if owner is None else await task_call(tm.list(owner, kind="template", limit=MAX_LISTED))
    items: dict[str, dict[str, Any]] = {}
    for s in everyone["tasks"]:
        if s.get("parent_id") == STATE_OPERATOR:
            items[s["task_id"]] = s
    for s in own["tasks"]:
        if s.get("parent_id") == STATE_UPLOAD:
            items[s["task_id"]] = s
    states = [
        {"name": tid[1:], "template_id": tid, "origin": _origin(s["parent_id"]), "created_at": s["created_at"]}
        for tid, s in sorted(items.items())
    ]
    return json_response({"object": "list", "data": states})


@router.get("/v1/states/{name:path}", responses=_answers(401, 404, 422, 503))
async def get_state(name: str, request: Request) -> Response:
    tm = task_manager(get_services(request))
    return json_response(_info(await _state_template(tm, name, get_owner(request))))


@router.delete("/v1/states/{name:path}", responses=_answers(401, 403, 404, 422, 503))
async def delete_state(name: str, request: Request) -> Response:
    tm = task_manager(get_services(request))
    owner = get_owner(request)
    t = await _state_template(tm, name, owner, write=True)
    await task_call(tm.delete(t.id, owner, force=True))
    return json_response({"name": name, "template_id": t.id, "deleted": True})


# --- export ------------------------------------------------------------------------------------
@router.get(
    "/v1/tasks/{task_id}/state", responses=_answers(401, 404, 409, 422, 503, ok_content=_FILE), response_class=Response
)
async def export_state(task_id: str, request: Request, format: Literal["full", "rwkv"] = Query("full")) -> Response:
    """The task's (or template's) last settled state as an RWKV-7 state file. full: with our keys
    (token shifts, pending tokens, metadata; a bit-exact round trip); rwkv: the bare file
    RWKV-Runner and the rwkv package load (the metadata in the X-RWKV-* headers)."""
    sv = get_services(request)
    tm = task_manager(sv)
    t = await task_call(tm.get(task_id, get_owner(request)))
    if t.running:
        raise ApiError(
            409,
            f"task {task_id} is running; export its state once it has finished",
            param="task_id",
            code="task_conflict",
        )
    state, pos, key = await task_call(tm.persistence.resolve_state(t))
    try:
        if state is None:
            why = (
                "has consumed none of its tokens yet (a prefill-only run holds its prompt's last token back, "
                "and its prompt is that one token): continue it with max_tokens of at least 1 to compute one"
                if pos == 0 and len(t.tokens) <= 1
                else "has no kept state (dropped by a budget); continue or fork it to compute one"
            )
            raise ApiError(409, f"task {task_id} {why}", param="task_id", code="state_not_kept")
        pending = list(t.tokens[pos:])
        meta = {
            "signature": sv.shape.signature(),
            "task_id": t.display_id,
            "state_pos": pos,
            "history_tokens": len(t.tokens),
            "exported_at": time.time(),
        }
        from server.model.state_file import write_state_file

        data = await asyncio.to_thread(write_state_file, state, full=format == "full", pending=pending, meta=meta)
    finally:
        tm.persistence.release(key)
    headers = {
        "Content-Disposition": f'attachment; filename="{t.display_id}.pth"',
        "X-RWKV-State-Format": format,
        "X-RWKV-Model": sv.shape.signature(),
        "X-RWKV-Pending-Count": str(len(pending)),
    }
    if len(pending) <= MAX_PENDING_HEADER:
        headers["X-RWKV-Pending-Tokens"] = ",".join(map(str, pending))
    return Response(data, media_type="application/octet-stream", headers=headers)
