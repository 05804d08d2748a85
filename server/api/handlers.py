"""Exception handlers: everything leaves in the OpenAI error shape, never FastAPI's {"detail": ...}.

Each handler also leaves its message in `request.state.error`: the access log line of a refused
request says why (server.api.middleware)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.errors import ERROR_TYPES, ApiError, error_body

log = logging.getLogger("server.http")

TASK_PREFIX = "/v1/tasks"


def _json(request: Request, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    request.state.error = body["error"]["message"]
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|bytes|[a-z-]+\[.*\]|function-.*|json-.*|[A-Z]\w*)$")


def param_of(loc: Sequence[Any]) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'; None for the body itself.
    pydantic adds union-branch tags (str, list[int], ContentPart, ...) to locations: dropped."""
    out = ""
    for i, p in enumerate(loc):
        if i == 0 and p in ("body", "query", "path", "header"):
            continue
        if isinstance(p, int):
            out += f"[{p}]" if out else ""
        elif not _TYPE_TAG.match(str(p)):
            out += ("." if out else "") + str(p)
    return out or None


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A readable message naming the first bad field, and that field."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"the request body is not valid JSON: {ctx.get('error', first.get('msg'))}", None
    param = param_of(first.get("loc", ()))
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object", None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        msg = f"'{param}' is required" if param else "a JSON body is required"
    elif first.get("type") == "extra_forbidden":
        msg = f"unknown field '{param}'"
    elif param:
        msg = f"invalid '{param}': {msg}"
    more = len(errors) - 1
    if more > 0:
        msg += f" (and {more} more problem{'s' if more > 1 else ''})"
    return msg, param


async def api_error_handler(request: Request, exc: ApiError) -> Response:
    request.state.error = exc.message
    return exc.response()


async def validation_handler(request: Request, exc: RequestValidationError) -> Response:
    status = 422 if request.url.path.startswith(TASK_PREFIX) else 400
    msg, param = validation_message(list(exc.errors()))
    return _json(request, status, error_body(msg, ERROR_TYPES[status], param, "invalid_request"))


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
    status = exc.status_code
    if status == 404:
        msg, code = f"no route {request.method} {request.url.path}", "not_found"
    elif status == 405:
        msg, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        msg, code = str(exc.detail), None
    return _json(request, status, error_body(msg, ERROR_TYPES.get(status, "invalid_request_error"), None, code),
                 headers=getattr(exc, "headers", None))


async def unhandled_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _json(request, 500, error_body("internal server error (see the server log)", "server_error", None,
                                          "internal_error"))


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, api_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unhandled_handler)
