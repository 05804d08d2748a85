"""OpenAPI `responses` of the lightning routes: what each can answer (the app documents every
status a route may send; lightning's errors are `{"error": "<text>"}`, ours `{"error": {...}}`)."""

from __future__ import annotations

from typing import Any

from server.api.openapi import SSE_EVENT

_WHY = {
    400: "an invalid field (our error shape), or one of lightning's: an empty batch, a batch beyond "
    "the queue (bsz overflow), a missing session_id / dialogue_idx",
    401: "API keys are configured and neither `password` nor `Authorization: Bearer` holds one",
    404: "unknown session or dialogue node (a negative dialogue_idx too); a session call whose session was "
    "deleted while it generated (`session_deleted`)",
    409: "the session is generating (one write to a session at a time); /state/delete: it is generating on "
    "another server of the database (`task_running_elsewhere`)",
    413: "a prompt or the body is too large",
    429: "the engine's queue is full; retry shortly",
    503: "the model is loading, the engine stopped, or the server is shutting down",
}
_ERROR = {"application/json": {"schema": {"type": "object", "properties": {"error": {}}}}}
_OK: dict[str, dict[str, Any]] = {
    "json": {"application/json": {"schema": {"type": "object"}}},
    "sse": {"text/event-stream": {"schema": SSE_EVENT}},
}


def responses(*errors: int, ok: tuple[str, ...] = ("json", "sse")) -> dict[int | str, dict[str, Any]]:
    """200 with the given content types, and the given error statuses."""
    out: dict[int | str, dict[str, Any]] = {
        200: {"description": "the answer", "content": {k: v for o in ok for k, v in _OK[o].items()}}
    }
    for status in errors:
        out[status] = {"description": _WHY[status], "content": _ERROR}
    return out


BATCH = responses(400, 401, 413, 429, 503)
SESSION = responses(400, 401, 404, 409, 413, 429, 503)
