"""Operations: /health (503 until ready) and /metrics (Prometheus text)."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.errors import error_body

router = APIRouter()


def _json(status: int, body: dict, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


@router.get("/health", include_in_schema=False)
async def health(request: Request) -> Response:
    services = request.app.state.services
    load_error = getattr(request.app.state, "load_error", None)
    if load_error:
        return _json(503, {"status": "failed", **error_body(f"loading failed: {load_error}",
                                                             "service_unavailable", None, "load_failed")})
    draining = getattr(request.app.state, "draining", None)
    if draining is not None and draining.is_set():
        return _json(503, {"status": "shutting_down", **error_body("the server is shutting down",
                                                                   "service_unavailable", None, "shutting_down")})
    if not services.ready:
        return _json(503, {"status": "loading", **error_body("the model is still loading", "service_unavailable",
                                                              None, "loading")}, {"Retry-After": "2"})
    engine = services.engine
    if engine is not None and not getattr(engine, "is_alive", True):
        return _json(503, {"status": "engine_dead", **error_body("the inference engine stopped; see the log",
                                                                 "service_unavailable", None, "engine_dead")})
    body = {"status": "ok", "model": services.model_id}
    try:
        st = engine.stats()
        body.update(running=st.running, waiting=st.waiting, slots=st.slots)
    except Exception:  # noqa: BLE001
        pass
    return _json(200, body)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    services = request.app.state.services
    text = services.metrics.render(services)
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
