"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}, used by every route
family, and the mapping of the engine's errors onto them."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

import orjson
from fastapi.responses import Response

from server.engine.types import EngineDeadError, EngineError, PromptTooLongError, QueueFullError, RequestFailedError
from server.tasks.errors import TaskError

# HTTP status -> OpenAI-style error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
HTTP_CODES = {413: "body_too_large"}
"""The code of an error raised as a bare HTTP status (the body limit met while the body streams)."""


class ApiError(Exception):
    """Raise from any route; the app's handler turns it into the OpenAI error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> Response:
        return Response(
            dumps_error(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def dumps_error(body: dict[str, Any]) -> bytes:
    """The JSON bytes of an error body. A message may quote the client's input, and that may hold
    a lone surrogate (which JSON text can escape but UTF-8 cannot carry): such text is written
    with backslash escapes rather than failing the error answer."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return orjson.dumps(_escaped(body))


def _escaped(v: Any) -> Any:
    if isinstance(v, str):
        return v.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(v, dict):
        return {_escaped(k): _escaped(x) for k, x in v.items()}
    return v


def task_error(exc: TaskError, param: str | None = None) -> ApiError:
    """The ApiError of a task-layer error: its status, code and param (or `param`), and
    `Retry-After` where the error gives one (a busy database)."""
    headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if exc.retry_after else None
    return ApiError(exc.status, exc.message, param=param or exc.param, code=exc.code, headers=headers)


T = TypeVar("T")


async def task_call(aw: Awaitable[T], invalid_status: int = 422) -> T:
    """Await a task-layer operation: its task and engine errors as ApiErrors (a bad value is
    `invalid_status`: 422 on the task routes)."""
    try:
        return await aw
    except TaskError as exc:
        raise task_error(exc) from None
    except (EngineError, ValueError) as exc:
        raise engine_error(exc, invalid_status=invalid_status) from None


def prompt_too_long(field: str, tokens: int, limit: int) -> ApiError:
    """The 413 of a prompt over --max-prompt-tokens, naming the request field it came from (every
    route's wording)."""
    return ApiError(413, f"'{field}' has {tokens} tokens; the limit is {limit}", param=field, code="prompt_too_long")


def engine_error(exc: Exception, invalid_status: int = 400) -> ApiError:
    """The ApiError of an engine error (a ValueError is the request's fault: `invalid_status`,
    400 on the OpenAI routes, 422 on the task routes); anything else is re-raised."""
    if isinstance(exc, QueueFullError):
        return ApiError(
            429,
            f"the server is busy (queue full): {exc}; retry shortly",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, PromptTooLongError):
        return prompt_too_long("prompt", exc.tokens, exc.limit)
    if isinstance(exc, EngineDeadError):
        return ApiError(503, f"the inference engine stopped: {exc}", code="engine_dead")
    if isinstance(exc, ValueError):
        return ApiError(invalid_status, str(exc), code="invalid_request")
    if isinstance(exc, RequestFailedError):
        return ApiError(500, f"generation failed: {exc}", code="generation_failed")
    raise exc
