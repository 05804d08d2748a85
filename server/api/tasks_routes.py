"""Task routes /v1/tasks/* (docs/task-api.md; compatible with the `rwkv-api` SDK 0.1.2).

Bodies are pydantic models with extra="forbid": unknown fields and out-of-range values are 422
(the app's validation handler names the field). Streams: `data: <compact JSON>` lines: a header
{task_id, prefill_time}, text events {data, task_id, gen_time, speed, pos}, a final event
{finished, finish_reason, usage, ...}, then `data: [DONE]`; an error after the start is a
`data: {"error": ...}` line, then [DONE]. A TMP_ task created by a streaming request is aborted
when that client disconnects; a TASK_ keeps running (resume with /stream?pos=N).
"""

from __future__ import annotations

import functools
from typing import Any, Awaitable, Literal, TypeVar

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from server.api.deps import get_owner, get_services
from server.api.errors import ApiError
from server.api import task_stream
from server.api.sse import SSEResponse
from server.engine.types import EngineDeadError, PromptTooLongError, QueueFullError
from server.tasks.errors import TaskError

router = APIRouter(prefix="/v1/tasks", tags=["tasks"])
T = TypeVar("T")
_MAX_INT = 2**63 - 1


class GenParams(BaseModel):
    """Generation parameters (all optional; absent = the task's / the server's defaults)."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: int | None = Field(None, ge=0, le=1_048_576, description="0 = prefill only")
    temperature: float | None = Field(None, ge=0, le=5)
    top_k: int | None = Field(None, ge=-1, le=1_000_000, description="-1 or 0 = no top-k cut")
    top_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-10, le=10)
    repetition_penalty: float | None = Field(None, ge=-10, le=10)
    penalty_decay: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, le=_MAX_INT)
    stream: bool = False
    stop: str | list[str] | None = Field(None, description="stop strings (ours)")
    stop_token_ids: list[int] | None = Field(None, max_length=64, description="(ours)")

    def params(self) -> dict[str, Any]:
        d = self.model_dump(exclude={"stream", "prompt", "prefix", "suffix"}, exclude_none=True)
        if isinstance(d.get("stop"), list) and len(d["stop"]) > 16:
            raise ApiError(422, "invalid 'stop': at most 16 stop strings", param="stop")
        return d


class CreateBody(GenParams):
    prompt: str | list[int]


class FimBody(GenParams):
    prefix: str
    suffix: str = ""


class UpdateBody(GenParams):
    prompt: str | list[int] | None = None


class EmptyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _json(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def _tasks(request: Request) -> Any:
    sv = get_services(request)
    if sv.tasks is None:
        raise ApiError(503, "the task manager is not running", code="tasks_unavailable")
    return sv.tasks


async def _call(aw: Awaitable[T]) -> T:
    """Task-layer and engine errors -> ApiError (the OpenAI error shape)."""
    try:
        return await aw
    except TaskError as exc:
        raise ApiError(exc.status, exc.message, param=exc.param, code=exc.code) from None
    except QueueFullError as exc:
        raise ApiError(429, f"the server is busy (queue full): {exc}; retry shortly",
                       code="queue_full", headers={"Retry-After": "1"}) from None
    except PromptTooLongError as exc:
        raise ApiError(413, f"prompt too long: {exc}", param="prompt", code="prompt_too_long") from None
    except EngineDeadError as exc:
        raise ApiError(503, f"the inference engine stopped: {exc}", code="engine_dead") from None
    except ValueError as exc:
        raise ApiError(422, str(exc), code="invalid_request") from None


def _answer(request: Request, tm: Any, t: Any, stream: bool, *, own: bool = False) -> Response:
    if not stream:
        return _json(t.response())
    return _sse(request, tm, t, 0, abort_on_close=own and t.kind == "tmp")


def _sse(request: Request, tm: Any, t: Any, pos: int, abort_on_close: bool = False) -> SSEResponse:
    """The task's stream from token `pos` (server.api.task_stream: written straight to the
    connection where it allows, else by the loop generator). Its Output is bound now: the stream
    shows that output, whatever the task does later (e.g. a continue with a new prompt). A
    streaming request's own TMP_ task is aborted when the stream stops before its end."""
    out = t.out

    def on_end(finished: bool) -> None:
        if abort_on_close and not finished and t.running:
            tm.abort(t)

    sv = request.app.state.services
    direct = None
    if sv.settings.direct_stream:
        direct = functools.partial(task_stream.TaskDirect.attach, t, out, pos, on_end)
    return SSEResponse(task_stream.body(t, pos, out, on_end=on_end), direct=direct,
                       metrics=getattr(sv, "metrics", None))


# --- create ------------------------------------------------------------------------------------
@router.post("/tmp")
async def create_tmp(body: CreateBody, request: Request) -> Response:
    tm = _tasks(request)
    t = await _call(tm.create(body.prompt, body.params(), persistent=False, owner=get_owner(request)))
    return _answer(request, tm, t, body.stream, own=True)


@router.post("/create")
async def create_task(body: CreateBody, request: Request) -> Response:
    tm = _tasks(request)
    t = await _call(tm.create(body.prompt, body.params(), persistent=True, owner=get_owner(request)))
    return _answer(request, tm, t, body.stream, own=True)


@router.post("/fim")
async def fim(body: FimBody, request: Request) -> Response:
    tm = _tasks(request)
    t = await _call(tm.fim(body.prefix, body.suffix, body.params(), owner=get_owner(request)))
    return _answer(request, tm, t, body.stream, own=True)


# --- read --------------------------------------------------------------------------------------
@router.get("/list")
async def list_tasks(request: Request, limit: int = Query(100, ge=1, le=1000),
                     offset: int = Query(0, ge=0),
                     kind: Literal["tmp", "task", "template"] | None = Query(None)) -> Response:
    tm = _tasks(request)
    return _json(await _call(tm.list(get_owner(request), limit=limit, offset=offset, kind=kind)))


@router.get("/{task_id}/get_result")
async def get_result(task_id: str, request: Request) -> Response:
    tm = _tasks(request)
    return _json((await _call(tm.get(task_id, get_owner(request)))).response())


@router.get("/{task_id}/status")
async def status(task_id: str, request: Request) -> Response:
    tm = _tasks(request)
    return _json((await _call(tm.get(task_id, get_owner(request)))).info())


@router.get("/{task_id}/stream")
async def stream(task_id: str, request: Request, pos: int = Query(0, ge=0)) -> Response:
    tm = _tasks(request)
    t = await _call(tm.get(task_id, get_owner(request)))
    return _sse(request, tm, t, pos)


# --- change ------------------------------------------------------------------------------------
@router.post("/{task_id}/fork")
async def fork(task_id: str, request: Request, body: UpdateBody | None = None,
               tmp: bool = Query(False)) -> Response:
    tm, body = _tasks(request), body or UpdateBody()
    t = await _call(tm.fork(task_id, body.params(), body.prompt, tmp=tmp, owner=get_owner(request)))
    return _answer(request, tm, t, body.stream, own=True)


@router.post("/{task_id}/continue")
async def continue_task(task_id: str, request: Request, body: UpdateBody | None = None,
                        force: bool = Query(False)) -> Response:
    tm, body = _tasks(request), body or UpdateBody()
    t = await _call(tm.continue_(task_id, body.params(), body.prompt, owner=get_owner(request),
                                 force=force))
    return _answer(request, tm, t, body.stream)


@router.post("/{task_id}/stop")
async def stop(task_id: str, request: Request, body: EmptyBody | None = None,
               force: bool = Query(False)) -> Response:
    tm = _tasks(request)
    t = await _call(tm.stop(task_id, get_owner(request), force=force))
    return _json(t.info())


@router.post("/{task_id}/as_template")
async def as_template(task_id: str, request: Request, body: EmptyBody | None = None,
                      name: str | None = Query(None, min_length=1, max_length=64)) -> Response:
    tm = _tasks(request)
    t = await _call(tm.as_template(task_id, get_owner(request), name=name))
    return _json(t.response())


@router.post("/{task_id}/delete")
async def delete(task_id: str, request: Request, body: EmptyBody | None = None,
                 force: bool = Query(False)) -> Response:
    tm = _tasks(request)
    t = await _call(tm.delete(task_id, get_owner(request), force=force))
    return _json(t.info())
