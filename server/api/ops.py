"""Operations: /health (503 until ready), /metrics (Prometheus text, or OpenMetrics for a scraper
that accepts it) and the Swagger page /docs
(its script from a CDN, with a pointer to /openapi.json where that cannot load)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from server.api.errors import error_body
from server.api.metrics import OPENMETRICS, OPENMETRICS_TYPE, Metrics, openmetrics
from server.api.services import Services
from server.api.streaming.watch import draining
from server.tasks.dbfaults import Availability

log = logging.getLogger(__name__)

router = APIRouter()


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def _unavailable(status: str, message: str, code: str, headers: dict[str, str] | None = None) -> Response:
    return _json(503, {"status": status, **error_body(message, "service_unavailable", None, code)}, headers)


_STATUS = {"type": "object", "properties": {"status": {"type": "string"}}, "required": ["status"]}
_HEALTH: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Ready: `status` ok, the model id, the engine's running / waiting / slots, and "
        "`database` (ok, or unavailable with `database_error` and `database_unavailable_since`: the task "
        "database failed its last use)",
        "content": {"application/json": {"schema": _STATUS}},
    },
    503: {
        "description": "Not ready: `status` loading (Retry-After), failed, shutting_down or engine_dead, with "
        "the error object",
        "content": {"application/json": {"schema": _STATUS}},
    },
}
_TEXT = {"text/plain": {"schema": {"type": "string"}}}
_METRICS: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text format 0.0.4, or OpenMetrics 1.0 where the Accept header names it",
        "content": {**_TEXT, OPENMETRICS: {"schema": {"type": "string"}}},
    }
}


@router.get("/health", responses=_HEALTH, tags=["operations"])
async def health(request: Request) -> Response:
    state = request.app.state
    services: Services | None = state.services
    if state.load_error:
        return _unavailable("failed", f"loading failed: {state.load_error}", "load_failed")
    if draining(request.app):
        return _unavailable("shutting_down", "the server is shutting down", "shutting_down")
    if services is None:
        return _unavailable("loading", "the model is still loading", "loading", {"Retry-After": "2"})
    if not services.engine.is_alive:
        return _unavailable("engine_dead", "the inference engine stopped; see the log", "engine_dead")
    body: dict[str, Any] = {"status": "ok", "model": services.model_id}
    with contextlib.suppress(Exception):  # a dead engine's figures: the status says enough
        st = services.engine.stats()
        body.update(running=st.running, waiting=st.waiting, slots=st.slots)
        if st.engines > 1:  # one engine per device (--devices)
            body.update(engines=st.engines, engines_alive=st.engines_alive)
    if services.tasks is not None:
        keyed = bool(services.settings.api_keys or services.settings.api_key_file)
        body.update(_database(services.tasks.store.outages.now, keyed))
    return _json(200, body)


def _database(now: Availability, keyed: bool) -> dict[str, Any]:
    """/health's database fields. An unavailable database is no 503 here: what needs none
    (completions, chat, TMP tasks) still answers, and the task routes answer 503
    `database_unavailable` themselves; replicas on one database would all fail the probe at once.
    With API keys on, the error's text (which may name the database's address) is left to the
    log: /health needs no key."""
    if now.ok:
        return {"database": "ok"}
    error = {} if keyed else {"database_error": now.error}
    return {"database": "unavailable", **error, "database_unavailable_since": now.since}


@router.get("/metrics", responses=_METRICS, tags=["operations"])
async def metrics(request: Request) -> Response:
    services: Services | None = request.app.state.services
    m: Metrics = request.app.state.metrics
    text = m.render() if services is None else m.render(services.engine, _tiers(services))
    if services is not None and services.tasks is not None:
        text += _task_counters(services) + _database_gauge(services)
    accepted = (part.split(";")[0].strip() for part in request.headers.get("accept", "").split(","))
    if OPENMETRICS in accepted:  # Prometheus asks for it first
        return Response(openmetrics(text), media_type=OPENMETRICS_TYPE)
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


# HEAD for the probes too (a load balancer's check): the same answer without its body; not in the
# document (one operation per route keeps the operation ids stable)
router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
router.add_api_route("/metrics", metrics, methods=["HEAD"], include_in_schema=False)


def _task_counters(services: Services) -> str:
    """The task layer's event counters (runs, rebuilds, rebuild_tokens, state_misses, ...)."""
    try:
        counters = services.tasks.stats().get("counters", {}) if services.tasks is not None else {}
    except Exception:  # a failing figure must not break /metrics
        log.exception("task counters for /metrics failed")
        return ""
    lines = [
        "# HELP rwkv_task_events_total Task-layer events: runs, rebuilds (runs that re-fed history "
        "a missing state had consumed) and their tokens, state loads and misses, ...",
        "# TYPE rwkv_task_events_total counter",
    ]
    lines += [
        f'rwkv_task_events_total{{event="{k}"}} {v}' for k, v in sorted(counters.items()) if isinstance(v, (int, float))
    ]
    return "\n".join(lines) + "\n"


def _database_gauge(services: Services) -> str:
    """rwkv_database_available: the task database answered this server's last use of it."""
    if services.tasks is None:
        return ""
    return (
        "# HELP rwkv_database_available Whether the task database answered this server's last use of it "
        "(1) or failed it (0: requests that need it answer 503 database_unavailable)\n"
        "# TYPE rwkv_database_available gauge\n"
        f"rwkv_database_available {int(services.tasks.store.outages.now.ok)}\n"
    )


def _tiers(services: Services) -> dict[str, dict[str, Any]]:
    """State cache figures per tier: the task manager's tiers and the chat-prefix cache."""
    tiers: dict[str, dict[str, Any]] = {}
    if services.tasks is not None:
        with contextlib.suppress(Exception):  # a failing figure must not break /metrics
            tiers.update(services.tasks.stats().get("tiers", {}))
    tiers["prefix"] = services.prefix_cache.stats()
    return tiers


_OFFLINE = """<script>
if (typeof SwaggerUIBundle === "undefined") {
  document.getElementById("swagger-ui").innerHTML = "<p style='font-family:sans-serif;margin:2em'>" +
    "This page loads Swagger UI from cdn.jsdelivr.net, which this browser cannot reach. " +
    "The API description itself is served here: <a href='/openapi.json'>/openapi.json</a>.</p>";
}
</script>
</body>"""


@router.get("/docs", include_in_schema=False)
async def docs(request: Request) -> Response:
    """FastAPI's Swagger page, plus a line that names /openapi.json where the CDN is unreachable
    (an offline GPU host): without it the page stays blank."""
    page = get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} - docs")
    html = bytes(page.body).decode().replace("</body>", _OFFLINE, 1)
    return HTMLResponse(html)
