"""One pure-ASGI middleware: request ids, body-size limit, API keys, last-resort errors, access log.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect detection pass
through untouched.
"""

from __future__ import annotations

import contextvars
import hmac
import logging
import re
import time
import uuid
from typing import Any, Callable

import orjson
from starlette.exceptions import HTTPException

from server.api.errors import error_body

log = logging.getLogger("server.http")

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_RID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
OPEN_PATHS = ("/health", "/metrics")


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every log record (the formatter prints it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


def _header(scope: dict, name: bytes) -> str | None:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _json_error(status: int, message: str, type_: str, code: str | None, rid: str,
                extra: dict[str, str] | None = None) -> tuple[dict, dict]:
    body = orjson.dumps(error_body(message, type_, None, code))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"x-request-id", rid.encode())]
    for k, v in (extra or {}).items():
        headers.append((k.lower().encode(), v.encode()))
    return ({"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body})


class ServerMiddleware:
    def __init__(self, app: Callable, *, max_body_bytes: int, api_keys: frozenset[str],
                 metrics: Any = None) -> None:
        self.app = app
        self.max_body = max_body_bytes
        self.keys = api_keys
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client_rid = _header(scope, b"x-request-id")
        rid = client_rid if client_rid and _RID_OK.match(client_rid) else uuid.uuid4().hex
        token = request_id_var.set(rid)
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        t0 = time.perf_counter()
        status_box = [0]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            early = self._refuse(scope, state, rid)
            if early is not None:
                for msg in early:
                    await send_wrapper(msg)
                return
            await self._call(scope, receive, send_wrapper, status_box, rid)
        finally:
            self._log(scope, status_box[0], time.perf_counter() - t0)
            request_id_var.reset(token)

    def _refuse(self, scope: dict, state: dict, rid: str) -> tuple[dict, dict] | None:
        """Checks made before the app runs: body size by Content-Length, then the API key."""
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return _json_error(413, f"request body of {length} bytes exceeds the limit of "
                               f"{self.max_body} bytes", "request_too_large", "body_too_large", rid)
        path = scope.get("path", "")
        if self.keys and path.startswith("/v1") and path not in OPEN_PATHS:
            key = _bearer(_header(scope, b"authorization"))
            owner = next((k for k in self.keys if key is not None and hmac.compare_digest(k, key)), None)
            if owner is None:
                msg = "missing API key: send 'Authorization: Bearer <key>'" if key is None else "invalid API key"
                return _json_error(401, msg, "authentication_error", "invalid_api_key", rid,
                                   {"www-authenticate": "Bearer"})
            state["owner"] = owner
        return None

    async def _call(self, scope: dict, receive: Callable, send: Callable, status_box: list, rid: str) -> None:
        seen = [0]

        async def limited_receive() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body:
                    raise HTTPException(413, f"request body exceeds the limit of {self.max_body} bytes")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except Exception as exc:  # noqa: BLE001 - last resort: the error shape, never a traceback page
            if isinstance(exc, HTTPException):
                status, msg, code = exc.status_code, str(exc.detail), None
            else:
                log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
                status, msg, code = 500, "internal server error (see the server log)", "internal_error"
            if status_box[0]:
                return  # the response already started; nothing more can be said
            from server.api.errors import ERROR_TYPES

            for msg_ in _json_error(status, msg, ERROR_TYPES.get(status, "server_error"), code, rid):
                await send(msg_)

    def _log(self, scope: dict, status: int, seconds: float) -> None:
        route = scope.get("route")
        route_path = getattr(route, "path", None) or "other"
        if self.metrics is not None:
            self.metrics.count_request(scope.get("method", ""), route_path, status)
        path = scope.get("path", "")
        if path in OPEN_PATHS and status == 200:
            return  # probes would drown the log
        client = scope.get("client") or ("-", 0)
        log.info('%s "%s %s" %s %.1fms', client[0], scope.get("method"), path, status, seconds * 1000)


def _bearer(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
