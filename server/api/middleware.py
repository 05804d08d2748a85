"""One pure-ASGI middleware: request ids, JSON bodies whatever their content type, body-size
limit, API keys, last-resort errors, the access log.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect detection pass
through untouched.

Access log: answered requests at DEBUG (an SDK polling every half second would flood INFO; the
HTTP stats line counts them), refused ones (4xx) at INFO and failed ones (5xx) at WARNING, each
with the reason (the error message a handler left in the request state).
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.api_keys import bearer_token, match_key
from server.api.errors import ERROR_TYPES, HTTP_CODES, error_body
from server.api.lightning.errors import UNAUTHORIZED
from server.api.lightning.paths import BODY_KEY_PATHS, KEY_PATHS, SHARED_PATH
from server.api.metrics import PROBE_ROUTES, Metrics

log = logging.getLogger("server.http")

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_RID_OK = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
OPEN_PATHS = PROBE_ROUTES  # no API key needed, no access log line when healthy
JSON = b"application/json"
KEY_DEFERRED = "key_deferred"
"""Request-state key: on a path of BODY_KEY_PATHS without a valid header the middleware leaves
the key check to the route (the body's `password`) and puts here the 401 message it would have
sent; `API_KEYS` then holds the keys to check against (server.api.lightning.auth)."""
API_KEYS = "api_keys"


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every log record (the formatter prints it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


BODY_METHODS = ("POST", "PUT", "PATCH")
"""The methods whose bodies the routes read (a GET's body is ignored, never parsed)."""
_READ_HEADERS = (b"x-request-id", b"content-length", b"authorization", b"content-type", b"content-encoding")


def _headers(scope: Scope) -> dict[bytes, bytes]:
    """The request headers this middleware reads (lower-case names; the first of repeated ones)."""
    out: dict[bytes, bytes] = {}
    for k, v in scope.get("headers") or ():
        k = k.lower()
        if k in _READ_HEADERS and k not in out:
            out[k] = v
    return out


def _as_json(scope: Scope, content_type: bytes | None) -> None:
    """Every body is read as JSON, whatever its content type says (curl -d sends a form type, some
    clients none): a body that is not JSON gets the "not valid JSON" error naming the problem."""
    kind = (content_type or b"").split(b";")[0].strip().lower()
    if kind == JSON or (kind.startswith(b"application/") and kind.endswith(b"+json")):
        return
    scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
    scope["headers"].append((b"content-type", JSON))


def _json_error(
    status: int,
    message: str,
    type_: str,
    code: str | None,
    rid: str,
    extra: dict[str, str] | None = None,
    body: bytes | None = None,
) -> tuple[Message, Message]:
    """The answer to a refused request: our error shape, or `body` as it is."""
    body = body if body is not None else orjson.dumps(error_body(message, type_, None, code))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", rid.encode()),
    ]
    for k, v in (extra or {}).items():
        headers.append((k.lower().encode(), v.encode()))
    return (
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": body},
    )


class ServerMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        api_keys: frozenset[str],
        metrics: Metrics | None = None,
        raw_bodies: tuple[tuple[str, int], ...] = (),
        access_log: bool = False,
        routes: Sequence[BaseRoute] = (),
    ) -> None:
        """raw_bodies: (path prefix, byte limit) of routes whose bodies are files, not JSON: their
        content type is kept and their limit replaces max_body_bytes (e.g. state file uploads).
        access_log: successes are logged at info (else at debug). routes: the app's routes, which
        name the route of a request refused here before routing (its metrics label)."""
        self.app = app
        self.success_level = logging.INFO if access_log else logging.DEBUG
        self.max_body = max_body_bytes
        self.keys = api_keys
        self.metrics = metrics
        self.raw_bodies = raw_bodies
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        client_rid = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = client_rid if client_rid and _RID_OK.fullmatch(client_rid) else uuid.uuid4().hex
        token = request_id_var.set(rid)
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        t0 = time.perf_counter()
        status_box = [0]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            path = scope.get("path", "")
            raw = next((limit for prefix, limit in self.raw_bodies if path.startswith(prefix)), None)
            limit = self.max_body if raw is None else raw
            early = self._refuse(scope, headers, state, rid, limit)
            if early is not None:
                for msg in early:
                    await send_wrapper(msg)
                return
            if raw is None:
                _as_json(scope, headers.get(b"content-type"))
            await self._call(scope, receive, send_wrapper, status_box, rid, limit, raw is None)
        finally:
            self._log(scope, status_box[0], time.perf_counter() - t0, state.get("error"))
            request_id_var.reset(token)

    def _refuse(
        self, scope: Scope, headers: dict[bytes, bytes], state: dict[str, Any], rid: str, limit: int
    ) -> tuple[Message, Message] | None:
        """Checks made before the app runs: body size by Content-Length, its encoding, then the API key."""
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > limit:
            state["error"] = f"request body of {length} bytes exceeds the limit of {limit} bytes"
            return _json_error(413, state["error"], "request_too_large", "body_too_large", rid)
        coding = headers.get(b"content-encoding", b"").decode("latin-1").strip()
        if coding and coding.lower() != "identity" and scope.get("method") in BODY_METHODS:
            # a compressed body would be read as garbage (a GET's body is never read)
            state["error"] = f"Content-Encoding {coding!r} is not supported: send the body uncompressed"
            return _json_error(415, state["error"], "invalid_request_error", "unsupported_encoding", rid)
        path = scope.get("path", "")
        if self.keys and (path.startswith("/v1") or path in KEY_PATHS) and path not in OPEN_PATHS:
            key = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
            owner = match_key(self.keys, None if key is None else key.encode("latin-1"))  # the raw bytes
            if owner is None:
                msg = "missing API key: send 'Authorization: Bearer <key>'" if key is None else "invalid API key"
                if path in BODY_KEY_PATHS and scope.get("method") == "POST":
                    state[KEY_DEFERRED], state[API_KEYS] = msg, self.keys  # the route checks `password`
                    return None
                state["error"] = msg
                own = orjson.dumps({"error": UNAUTHORIZED}) if path in KEY_PATHS and path != SHARED_PATH else None
                return _json_error(  # a lightning path answers in lightning's shape
                    401, msg, "authentication_error", "invalid_api_key", rid, {"www-authenticate": "Bearer"}, own
                )
            state["owner"] = owner
        return None

    async def _call(
        self, scope: Scope, receive: Receive, send: Send, status_box: list[int], rid: str, limit: int, json: bool
    ) -> None:
        """json: the body is read as JSON, which must be UTF-8 (json.loads would take UTF-16 and
        UTF-32 too: NotUtf8 from the first bytes, which the app's handler reports)."""
        seen = [0]

        async def limited_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                if json and seen[0] == 0 and body:
                    _check_utf8_start(body)
                seen[0] += len(body)
                if seen[0] > limit:
                    raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except Exception as exc:  # last resort: the error shape, never a traceback page
            if isinstance(exc, HTTPException):
                status, msg, code = exc.status_code, str(exc.detail), HTTP_CODES.get(exc.status_code)
            else:
                log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
                status, msg, code = 500, "internal server error (see the server log)", "internal_error"
            scope.setdefault("state", {})["error"] = msg
            if status_box[0]:
                return  # the response already started; nothing more can be said
            for msg_ in _json_error(status, msg, ERROR_TYPES.get(status, "server_error"), code, rid):
                await send(msg_)

    def _route_path(self, scope: Scope) -> str:
        """The path of the route that answered, or would have answered a request refused here;
        "other" where no route has this path."""
        route = scope.get("route")
        if route is None:
            found = [(m, r) for r in self.routes for m in (r.matches(scope)[0],) if m != Match.NONE]
            route = min(found, key=lambda mr: mr[0] != Match.FULL, default=(None, None))[1]
        return getattr(route, "path", None) or "other"

    def _log(self, scope: Scope, status: int, seconds: float, error: str | None) -> None:
        route_path = self._route_path(scope)
        if self.metrics is not None:
            self.metrics.count_request(scope.get("method", ""), route_path, status)
        path = scope.get("path", "")
        if status < 400:
            if path not in OPEN_PATHS:  # probes would drown even the debug log
                log.log(
                    self.success_level,
                    '%s "%s %s" %s %.1fms',
                    _client(scope),
                    scope.get("method"),
                    printable(path),
                    status,
                    seconds * 1000,
                )
            return
        level = logging.WARNING if status >= 500 else logging.INFO
        if path in OPEN_PATHS:  # a probe's 503 (loading, draining) is the probe doing its job
            level = logging.DEBUG
        log.log(
            level,
            '%s "%s %s" %s %.1fms: %s',
            _client(scope),
            scope.get("method"),
            printable(path),
            status,
            seconds * 1000,
            printable(error or "(no reason given)"),
        )


class NotUtf8(ValueError):
    """A JSON body in another Unicode encoding (the message says which); FastAPI's body read
    turns it into its 400, whose cause the app's handler reports (handlers.unparseable_body)."""


def _check_utf8_start(body: bytes) -> None:
    """NotUtf8 for a body whose first bytes are UTF-16 or UTF-32 (a BOM, or a zero byte: JSON
    text in UTF-8 has none, as RFC 8259 requires UTF-8 where it has no BOM)."""
    head = body[:4]
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in head:
        raise NotUtf8("the request body is not UTF-8 (it looks like UTF-16 or UTF-32): send JSON as UTF-8")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def printable(text: str) -> str:
    """text with its control characters escaped (\\x0a): a path or an error message quoting the
    client's input cannot break the log into forged lines."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _client(scope: Scope) -> str:
    client = scope.get("client") or ("-", 0)
    return str(client[0])
