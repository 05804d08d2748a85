"""What the /v1/responses routes share: a stored response by its id, the previous response of a
create, the task layer's and the engine's errors in this family's words (`call`), the turn break
between a history and new turns, and the wait for a run's end while the client is watched."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request

from server.api.errors import ApiError, engine_error, prompt_too_long, task_error
from server.api.responses import render
from server.api.services import Services
from server.api.streaming.watch import done_or_gone
from server.engine.types import EOS_TOKEN, EngineError, PromptTooLongError
from server.tasks.errors import TaskElsewhere, TaskError, TaskNotFound

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

T = TypeVar("T")


async def call(aw: Awaitable[T]) -> T:
    """Task-layer and engine errors -> ApiError (a bad value is a 400, as on the OpenAI routes).
    The task's prompt is this route's `input`: an error about it names `input`."""
    try:
        return await aw
    except TaskError as exc:
        raise task_error_of(exc) from None
    except (EngineError, ValueError) as exc:
        if isinstance(exc, PromptTooLongError):
            raise prompt_too_long("input", exc.tokens, exc.limit) from None
        err = engine_error(exc)
        err.param = "input" if err.param == "prompt" else err.param
        raise err from None


def task_error_of(exc: TaskError) -> ApiError:
    """errors.task_error, with a bad value as the OpenAI routes' 400 and `prompt` named `input`;
    a response another server runs named as the response."""
    err = task_error(exc, param="input" if exc.param == "prompt" else exc.param)
    if err.status == 422:
        err.status = 400
    if isinstance(exc, TaskElsewhere) and exc.task_id.startswith("TASK_"):
        rid, err.param = render.response_id_of(exc.task_id), "response_id"
        err.message = f"response {rid} is running on {exc.where}; send this request there"
    return err


async def stored(tm: TaskManager, rid: str, owner: str | None, param: str | None = None) -> Task:
    """The task of a stored response `owner` may see; 404 otherwise (unknown, another key's)."""
    tid = render.task_id(rid)
    try:
        if tid is None:
            raise TaskNotFound(rid)
        t = await tm.get(tid, owner)
        if not render.is_response(t):  # a /v1/tasks task or a lightning session: not ours
            raise TaskNotFound(rid)
        return t
    except TaskError as exc:
        if not isinstance(exc, TaskNotFound):
            raise task_error_of(exc) from None
        raise not_found(rid, param) from None


def not_found(rid: str, param: str | None) -> ApiError:
    return ApiError(404, f"response {rid!r} not found (unknown, not stored, or another API key's)", param=param,
                    code="response_not_found")  # fmt: skip


async def previous(tm: TaskManager, rid: str, owner: str | None) -> Task:
    """The task of previous_response_id: 404 (not found), 409 (still running)."""
    src = await stored(tm, rid, owner, "previous_response_id")
    if src.running and not src.stop_requested:  # (a stopping one: the fork waits for its settle)
        raise ApiError(409, f"response {rid!r} is still in progress", param="previous_response_id",
                       code="response_in_progress")  # fmt: skip
    return src


def separator(sv: Services, src: Task) -> str:
    """What goes between the previous response's history and the new turns: nothing after EOS
    or a turn break the model wrote, else the turn break."""
    tail = list(src.tokens[-2:])
    if not tail or tail[-1] == EOS_TOKEN or sv.tokenizer.decode(tail).endswith("\n\n"):
        return ""
    return "\n\n"


async def wait_end(request: Request, t: Task) -> bool:
    """Wait for the end of t's run: True once it ended, False when the client left first. 503
    when the server begins to shut down meanwhile (the caller stops the run)."""
    if not t.running or t.done is None:
        return True
    return await done_or_gone(request, t.done.wait())
