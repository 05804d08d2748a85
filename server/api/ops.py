"""Operations: /health (503 until ready) and /metrics (Prometheus text)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.errors import error_body
from server.api.metrics import Metrics
from server.api.services import Services

log = logging.getLogger(__name__)

router = APIRouter()


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def _unavailable(status: str, message: str, code: str, headers: dict[str, str] | None = None) -> Response:
    return _json(503, {"status": status, **error_body(message, "service_unavailable", None, code)}, headers)


@router.get("/health", include_in_schema=False)
async def health(request: Request) -> Response:
    state = request.app.state
    services: Services | None = state.services
    if state.load_error:
        return _unavailable("failed", f"loading failed: {state.load_error}", "load_failed")
    draining = getattr(state, "draining", None)
    if draining is not None and draining.is_set():
        return _unavailable("shutting_down", "the server is shutting down", "shutting_down")
    if services is None:
        return _unavailable("loading", "the model is still loading", "loading", {"Retry-After": "2"})
    if not services.engine.is_alive:
        return _unavailable("engine_dead", "the inference engine stopped; see the log", "engine_dead")
    body: dict[str, Any] = {"status": "ok", "model": services.model_id}
    with contextlib.suppress(Exception):  # a dead engine's figures: the status says enough
        st = services.engine.stats()
        body.update(running=st.running, waiting=st.waiting, slots=st.slots)
        if "engines" in st.extra:  # one engine per device (--devices)
            body.update(engines=st.extra["engines"], engines_alive=st.extra["engines_alive"])
    return _json(200, body)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    services: Services | None = request.app.state.services
    m: Metrics = request.app.state.metrics
    text = m.render() if services is None else m.render(services.engine, _tiers(services))
    if services is not None and services.tasks is not None:
        text += _task_counters(services)
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


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


def _tiers(services: Services) -> dict[str, dict[str, Any]]:
    """State cache figures per tier: the task manager's tiers and the chat-prefix cache."""
    tiers: dict[str, dict[str, Any]] = {}
    if services.tasks is not None:
        with contextlib.suppress(Exception):  # a failing figure must not break /metrics
            tiers.update(services.tasks.stats().get("tiers", {}))
    tiers["prefix"] = services.prefix_cache.stats()
    return tiers
