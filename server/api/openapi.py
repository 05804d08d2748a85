"""The OpenAPI document tells the truth: every status a route can answer, each error with the one error
model, and `text/event-stream` beside `application/json` where a route can stream.

Routes declare their answers with `responses=answers(...)` (the error statuses they can give, and
whether they stream); `install(app)` adds the error model to the document's components and drops
FastAPI's default 422 (a `{"detail": [...]}` body this server never sends: every route that can
answer 422 declares it with the error model). It also adds, to every operation, the statuses the
layers below the routes give whatever the route (HTTP_LAYER): 408 from the read deadlines
(server.api.http_limits: every request has headers, and an operation with a body a body too), 413
from the middleware's body limit and 415 from its Content-Encoding check (every operation with a
body; a route with a limit or media type of its own declares its 413 / 415 itself). Their bodies are
always the error model, on the rwkv_lightning routes too (neither comes from a route). Statuses
every route can give only through a bug or an overloaded host (500, the 503 of the connection bound)
are not listed per route.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, Field

JSON = "application/json"
SSE = "text/event-stream"
_REF = "#/components/schemas/{model}"
_FASTAPI_422 = ("HTTPValidationError", "ValidationError")


class ErrorDetail(BaseModel):
    message: str = Field(description="what was wrong, for a person")
    type: str = Field(description="the OpenAI error type of the status (invalid_request_error, ...)")
    param: str | None = Field(description="the offending field, where there is one (messages[0].role)")
    code: str | None = Field(description="a stable code for programs (invalid_request, queue_full, ...)")


class ErrorResponse(BaseModel):
    """Every error of every route: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


WHY = {
    400: "Invalid request (OpenAI routes): a field missing, unknown, of the wrong type or out of bounds, "
    "a body that is not JSON, a field this server cannot honour, or more sequences than the queue holds",
    401: "API keys are configured and the request has none, or a wrong one",
    403: "A write to a template without force=true, or to another key's template",
    404: "No such task (or another key's), no such model, or no such state (the OpenAI routes' `state`)",
    409: "The task is running, the template name exists, or a stored state cannot be used",
    413: "The body is over --max-body-bytes, or the prompt over --max-prompt-tokens",
    422: "Invalid request (task routes): a field or query value missing, unknown, of the wrong type or out "
    "of bounds, or a body that is not JSON",
    429: "The queue is full: retry after Retry-After seconds",
    503: "The model is loading (Retry-After), the engine stopped, or the task manager is not running",
}
_ERROR_CONTENT = {JSON: {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
LIGHTNING_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
    "description": "rwkv_lightning's error shape (lightning's own errors on its routes)",
}
_EITHER_CONTENT = {JSON: {"schema": {"oneOf": [{"$ref": _REF.format(model="ErrorResponse")}, LIGHTNING_ERROR]}}}
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "description": "One server-sent event (OpenAPI 3.1: the schema of a text/event-stream describes each event)",
    "properties": {
        "event": {"type": "string", "description": "the event's type (the Responses API's events)"},
        "data": {"type": "string", "description": "a compact JSON object, or [DONE] at the end (but Responses)"},
    },
}
RESPONSES_EVENTS = (
    "server-sent events (an `event: <type>` and a `data: {...}` line each, OpenAI's Responses events; no [DONE])"
)
"""`answers(events=...)` of the /v1/responses routes."""


class EventStream(Response):
    """The response class of a route that always answers SSE (for the document only; its 200
    answer gets SSE_EVENT from `answers(stream=True)`)."""

    media_type = SSE


def answers(
    *statuses: int,
    stream: bool = False,
    sse_only: bool = False,
    lightning: bool = False,
    events: str = "server-sent events (`data: {...}` lines, then `data: [DONE]`)",
) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: each error status with the error model; with `stream`, the 200
    answer is SSE (`stream: true`) as well as JSON; `sse_only`: always SSE (with EventStream as
    the route's response class); `lightning`: the route also serves rwkv_lightning's requests,
    whose own errors keep lightning's shape `{"error": "<text>"}`; `events`: what the stream is."""
    content = _EITHER_CONTENT if lightning else _ERROR_CONTENT
    out: dict[int | str, dict[str, Any]] = {s: {"description": WHY[s], "content": content} for s in statuses}
    if stream or sse_only:
        out[200] = {
            "description": events.capitalize() if sse_only else f"JSON, or with `stream: true` {events}",
            "content": {SSE: {"schema": SSE_EVENT}},
        }
    return out


HTTP_LAYER: dict[int, tuple[str | None, str]] = {
    # status -> (why, on an operation without a request body (None: not given there); why, with one)
    408: (
        "The request's headers did not arrive within --header-timeout seconds: the answer comes before any "
        "route runs, and the connection is closed",
        "The request's headers did not arrive within --header-timeout seconds, or its body not within "
        "--body-timeout seconds of them: the connection is closed",
    ),
    413: (None, "The body is over --max-body-bytes (the middleware's limit, before the route reads it)"),
    415: (None, "The body has a Content-Encoding other than identity (`unsupported_encoding`): send it uncompressed"),
}
"""The statuses `install` adds to the operations that do not declare them (see the module's doc)."""


def install(app: FastAPI) -> None:
    """Finish the app's document once, when it is first built (see the module's doc)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _finish(build())
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _finish(doc: dict[str, Any]) -> None:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    model = ErrorResponse.model_json_schema(ref_template=_REF)
    schemas.update(model.pop("$defs", {}))
    schemas["ErrorResponse"] = model
    for ops in doc.get("paths", {}).values():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            for status in [s for s, r in responses.items() if _is_fastapi_422(r)]:
                del responses[status]
            for status, (without_body, with_body) in HTTP_LAYER.items():
                why = with_body if "requestBody" in op else without_body
                if why is not None and str(status) not in responses:
                    responses[str(status)] = {"description": why, "content": _ERROR_CONTENT}
            op["responses"] = dict(sorted(responses.items(), key=lambda kv: (not kv[0].isdigit(), kv[0])))
    for name in _FASTAPI_422:
        schemas.pop(name, None)


def _is_fastapi_422(response: dict[str, Any]) -> bool:
    ref = response.get("content", {}).get(JSON, {}).get("schema", {}).get("$ref", "")
    return ref.endswith("/HTTPValidationError")
