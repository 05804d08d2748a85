"""Task routes /v1/tasks/* (docs/task-api.md; compatible with the `rwkv-api` SDK 0.1.2).

Bodies: server.api.tasks.schemas; unknown fields and out-of-range values are 422 naming the field
(server.api.sampling). Streams: `data: <compact JSON>` lines: a header
{task_id, prefill_time}, text events {data, task_id, gen_time, speed, pos}, a final event
{finished, finish_reason, usage, ...}, then `data: [DONE]`; an error after the start is a
`data: {"error": ...}` line, then [DONE]. A TMP_ task created by a streaming request is aborted
when that client disconnects; a TASK_ keeps running (resume with /stream?pos=N).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal
from urllib.parse import parse_qsl

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from server.api.errors import ApiError, task_call
from server.api.grammar import response_grammar
from server.api.openapi import EventStream, answers
from server.api.services import Services, get_owner, get_services, json_response, task_manager
from server.api.streaming.sse import SSEResponse
from server.api.tasks.schemas import CreateBody, EmptyBody, FimBody, GenParams, UpdateBody
from server.api.tasks.stream import TaskStream

if TYPE_CHECKING:
    from server.tasks.params import GivenParams
    from server.tasks.records import Task

router = APIRouter(prefix="/v1/tasks", tags=["tasks"])
PROMPT_SEARCH_MAX = 256  # characters of GET /list's prompt_contains


async def _params(sv: Services, body: GenParams) -> GivenParams:
    """The request's sampling fields and response_format, checked (422 naming a bad one; the
    engine compiles the format's grammar) before anything starts."""
    fields = body.checked_fields(sv.shape.vocab_size, sv.settings.max_tokens_limit)
    if body.response_format is not None:  # {"type": "text"} too: it overrides a fork source's format
        await response_grammar(sv, body.response_format, status=422)
        fields["response_format"] = body.response_format
    return fields


def _answer(sv: Services, t: Task, stream: bool, *, own: bool = False, pos: int = 0) -> Response:
    """The answer to a request that started a run of t (a stream: from output token `pos`). When
    it cannot be made, the run is stopped (and the task settles) before the error goes out:
    nothing runs for a request that failed."""
    try:
        if not stream:
            return json_response(t.response(sv.tasks.cache if sv.tasks is not None else None))
        return _sse(sv, t, pos, abort_on_close=own and t.kind == "tmp")
    except BaseException:
        if sv.tasks is not None:
            sv.tasks.abort(t)
        raise


def _sse(sv: Services, t: Task, pos: int, abort_on_close: bool = False) -> SSEResponse:
    """The task's stream from token `pos` (server.api.tasks.stream). A streaming request's own
    TMP_ task is aborted when the stream stops before its end."""
    tm = sv.tasks

    def on_abort() -> None:
        if tm is not None and t.running:
            tm.abort(t)

    source = TaskStream(t, pos, on_abort if abort_on_close else None)
    return SSEResponse(source, metrics=sv.metrics, direct=sv.settings.direct_stream)


# --- create ------------------------------------------------------------------------------------
async def _create(body: CreateBody, request: Request, *, persistent: bool) -> Response:
    sv = get_services(request)
    t = await task_call(
        task_manager(sv).create(body.prompt, await _params(sv, body), persistent=persistent, owner=get_owner(request))
    )
    return _answer(sv, t, bool(body.stream), own=True)


_STARTS = answers(401, 413, 422, 429, 503, stream=True)


@router.post("/tmp", responses=_STARTS)
async def create_tmp(body: CreateBody, request: Request) -> Response:
    return await _create(body, request, persistent=False)


@router.post("/create", responses=_STARTS)
async def create_task(body: CreateBody, request: Request) -> Response:
    return await _create(body, request, persistent=True)


@router.post("/fim", responses=_STARTS)
async def fim(body: FimBody, request: Request) -> Response:
    sv = get_services(request)
    tm = task_manager(sv)
    t = await task_call(tm.fim(body.prefix, body.suffix or "", await _params(sv, body), owner=get_owner(request)))
    return _answer(sv, t, bool(body.stream), own=True)


# --- read --------------------------------------------------------------------------------------
@router.get("/list", responses=answers(401, 422, 503))
async def list_tasks(
    request: Request,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=1_000_000),
    kind: Literal["tmp", "task", "template"] | None = Query(None),
    prompt_contains: str | None = Query(
        None,
        min_length=1,
        max_length=PROMPT_SEARCH_MAX,
        description="only the tasks whose last prompt's text contains this text, ASCII letters of either case alike",
    ),
) -> Response:
    if prompt_contains is not None and ("\x00" in prompt_contains or "\uffff" in prompt_contains):
        # PostgreSQL text holds no NUL: a prompt with one is stored escaped with U+FFFF, and searched
        # with each escape read as one U+FFFF (Listing.list_tasks), so neither can be looked for
        raise ApiError(
            422,
            "invalid 'prompt_contains': NUL (U+0000) and U+FFFF cannot be searched for",
            param="prompt_contains",
            code="invalid_request",
        )
    if prompt_contains is not None and "\ufffd" in prompt_contains and not _utf8_query(request):
        # the query's bytes are not UTF-8 (read as U+FFFD): such a search would match prompts with U+FFFD
        raise ApiError(422, "invalid 'prompt_contains': not UTF-8 once percent-decoded", param="prompt_contains",
                       code="invalid_request")  # fmt: skip
    tm = task_manager(get_services(request))
    listed = tm.list(get_owner(request), limit=limit, offset=offset, kind=kind, prompt_contains=prompt_contains)
    return json_response(await task_call(listed))


def _utf8_query(request: Request) -> bool:
    """Whether the query string's percent-decoded bytes are UTF-8 (Starlette reads others as U+FFFD)."""
    try:
        parse_qsl(request.scope.get("query_string", b"").decode("latin-1"), encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        return False
    return True


_READS = answers(401, 404, 422, 503)


@router.get("/{task_id}/get_result", responses=_READS)
async def get_result(task_id: str, request: Request) -> Response:
    tm = task_manager(get_services(request))
    return json_response((await task_call(tm.get(task_id, get_owner(request)))).response(tm.cache))


@router.get("/{task_id}/status", responses=_READS)
async def status(task_id: str, request: Request) -> Response:
    tm = task_manager(get_services(request))
    return json_response((await task_call(tm.get(task_id, get_owner(request)))).info())


@router.get("/{task_id}/stream", responses=answers(401, 404, 409, 422, 503, sse_only=True), response_class=EventStream)
async def stream(task_id: str, request: Request, pos: int = Query(0, ge=0)) -> Response:
    sv = get_services(request)
    tm = task_manager(sv)
    t = await task_call(tm.get(task_id, get_owner(request), stream=True))  # 409 while another instance runs it
    return _sse(sv, t, pos)


# --- change ------------------------------------------------------------------------------------
@router.post("/{task_id}/fork", responses=answers(401, 404, 409, 413, 422, 429, 503, stream=True))
async def fork(task_id: str, request: Request, body: UpdateBody | None = None, tmp: bool = Query(False)) -> Response:
    sv, body = get_services(request), body or UpdateBody()
    tm = task_manager(sv)
    t = await task_call(tm.fork(task_id, await _params(sv, body), body.prompt, tmp=tmp, owner=get_owner(request)))
    return _answer(sv, t, bool(body.stream), own=True)


@router.post("/{task_id}/continue", responses=answers(401, 403, 404, 409, 413, 422, 429, 503, stream=True))
async def continue_task(
    task_id: str, request: Request, body: UpdateBody | None = None, force: bool = Query(False)
) -> Response:
    sv, body = get_services(request), body or UpdateBody()
    tm = task_manager(sv)
    t = await task_call(
        tm.continue_(task_id, await _params(sv, body), body.prompt, owner=get_owner(request), force=force)
    )
    # a continue without a prompt extends the output: its stream starts where the output stood
    return _answer(sv, t, bool(body.stream), pos=t.run_from)


@router.post("/{task_id}/stop", responses=answers(401, 403, 404, 409, 413, 422, 503))
async def stop(task_id: str, request: Request, body: EmptyBody | None = None, force: bool = Query(False)) -> Response:
    tm = task_manager(get_services(request))
    t = await task_call(tm.stop(task_id, get_owner(request), force=force))
    return json_response(t.info())


@router.post("/{task_id}/as_template", responses=answers(401, 404, 409, 413, 422, 503))
async def as_template(
    task_id: str,
    request: Request,
    body: EmptyBody | None = None,
    name: str | None = Query(None, min_length=1, max_length=64),
    public: bool = Query(False),
) -> Response:
    """public=true: every API key may read and fork the template (default: private to this key)."""
    tm = task_manager(get_services(request))
    t = await task_call(tm.as_template(task_id, get_owner(request), name=name, public=public))
    return json_response(t.response(tm.cache))


@router.post("/{task_id}/delete", responses=answers(401, 403, 404, 409, 413, 422, 503))
async def delete(task_id: str, request: Request, body: EmptyBody | None = None, force: bool = Query(False)) -> Response:
    tm = task_manager(get_services(request))
    t = await task_call(tm.delete(task_id, get_owner(request), force=force))
    return json_response(t.info())
