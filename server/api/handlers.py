"""Exception handlers: everything leaves in the OpenAI error shape, never FastAPI's {"detail": ...}.

Each handler also leaves its message in `request.state.error`: the access log line of a refused
request says why (server.api.middleware)."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.errors import ERROR_TYPES, HTTP_CODES, ApiError, dumps_error, error_body
from server.api.generation.jobs import ClientGone
from server.api.metrics import CLIENT_GONE
from server.api.middleware import NotUtf8

log = logging.getLogger("server.http")

TASK_PREFIXES = ("/v1/tasks", "/v1/ui/tasks")
"""Routes of the task family (a bad request is 422): the task API and the dashboard's task view."""


def _json(request: Request, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    request.state.error = body["error"]["message"]
    return Response(dumps_error(body), status_code=status, media_type="application/json", headers=headers)


_TYPE_TAG = re.compile(
    r"^(str|int|float|bool|none|bytes|constrained-\w+|[a-z-]+\[.*\]|function-.*|json-.*"
    r"|[A-Z]\w*)$"
)


def param_of(loc: Sequence[Any]) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'; None for the body itself.
    pydantic adds union-branch tags (str, list[int], ContentPart, ...) to locations: dropped. A
    value inside a list of values is named by the list (('body', 'stop', 1) -> 'stop')."""
    out = ""
    for i, p in enumerate(loc):
        if i == 0 and p in ("body", "query", "path", "header"):
            continue
        if isinstance(p, int):
            out += f"[{p}]" if out and any(not _is_tag(q) for q in loc[i + 1 :]) else ""
        elif not _is_tag(p):
            out += ("." if out else "") + str(p)
    return out or None


def _is_tag(p: Any) -> bool:
    return isinstance(p, str) and bool(_TYPE_TAG.match(p))


def _most_telling(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error to report among those of the first bad field: a union value fails every branch,
    and the deepest failure (then one that is not a plain type mismatch) says what was wrong
    ([70000] as a prompt: "less than 65536", not "not a valid string")."""
    param = param_of(errors[0].get("loc", ()))
    same = [e for e in errors if param_of(e.get("loc", ())) == param]
    return max(same, key=lambda e: (len(e.get("loc", ())), not str(e.get("type", "")).endswith("_type")))


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A readable message naming the first bad field, and that field."""
    if not errors:
        return "invalid request", None
    first = _most_telling(errors)
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"the request body is not valid JSON: {ctx.get('error', first.get('msg'))}", None
    param = param_of(first.get("loc", ()))
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object", None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "value_error":  # a validator's own words, without pydantic's prefix
        msg = msg.removeprefix("Value error, ")
    if first.get("type") == "string_unicode":  # pydantic's word for a lone surrogate in a constrained str
        msg = "not valid UTF-8 text (a lone surrogate)"
    if first.get("type") == "missing":
        msg = f"'{param}' is required" if param else "a JSON body is required"
    elif first.get("type") == "extra_forbidden":
        msg = f"unknown field '{param}'"
    elif param and "input" in first and first["input"] is None and str(first.get("type")).endswith("_type"):
        msg = f"invalid '{param}': null is not allowed here ({msg[:1].lower()}{msg[1:]})"
    elif param:
        msg = f"invalid '{param}': {msg}"
    more = len({param_of(e.get("loc", ())) for e in errors}) - 1
    if more > 0:
        msg += f" (and {more} more problem{'s' if more > 1 else ''})"
    return msg, param


async def api_error_handler(request: Request, exc: ApiError) -> Response:
    request.state.error = exc.message
    return exc.response()


def _invalid_status(request: Request) -> int:
    """The route family's status of an invalid request: 422 on the task routes, 400 elsewhere."""
    return 422 if request.url.path.startswith(TASK_PREFIXES) else 400


async def validation_handler(request: Request, exc: RequestValidationError) -> Response:
    status = _invalid_status(request)
    msg, param = validation_message(list(exc.errors()))
    return _json(request, status, error_body(msg, ERROR_TYPES[status], param, "invalid_request"))


def unparseable_body(exc: StarletteHTTPException) -> str | None:
    """Why the body could not be parsed, when FastAPI's 400 "There was an error parsing the body"
    is what `exc` is (raised from the JSON parser's error: invalid UTF-8, nesting past the
    parser's recursion limit, an integer past Python's digit limit); None for any other error."""
    cause = exc.__cause__
    if exc.status_code != 400 or cause is None:
        return None
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8 (byte {cause.start})"
    if isinstance(cause, NotUtf8):
        return str(cause)
    if isinstance(cause, RecursionError):
        return "the request body is not valid JSON: it is nested too deeply"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return f"the request body is not valid JSON: a number has more than {sys.get_int_max_str_digits()} digits"
    return f"the request body is not valid JSON ({type(cause).__name__})"


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
    status = exc.status_code
    unparseable = unparseable_body(exc)
    if unparseable is not None:
        status = _invalid_status(request)
        return _json(request, status, error_body(unparseable, ERROR_TYPES[status], None, "invalid_request"))
    code: str | None
    if status == 404:
        msg, code = f"no route {request.method} {request.url.path}", "not_found"
    elif status == 405:
        msg, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        msg, code = str(exc.detail), HTTP_CODES.get(status)
    return _json(
        request,
        status,
        error_body(msg, ERROR_TYPES.get(status, "invalid_request_error"), None, code),
        headers=getattr(exc, "headers", None),
    )


async def unhandled_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _json(
        request, 500, error_body("internal server error (see the server log)", "server_error", None, "internal_error")
    )


async def client_gone_handler(request: Request, exc: ClientGone) -> Response:
    """The client left before the answer: 499 (logged and counted, never sent)."""
    request.state.error = "the client left before the answer"
    return Response(status_code=CLIENT_GONE)  # counted as an abort (Metrics.count_request)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ClientGone, client_gone_handler)  # type: ignore[arg-type]
    app.add_exception_handler(ApiError, api_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unhandled_handler)
