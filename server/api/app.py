"""The FastAPI application: lifespan (load in a thread, start engine + tasks), routes, middleware."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI

from server.api import handlers
from server.api.deps import Services
from server.api.loading import facts, load_services, prefix_budget
from server.api.generation import Recorder
from server.api.metrics import Metrics
from server.api.middleware import ServerMiddleware
from server.api.prefix_cache import PrefixCache
from server.api.sse import RAW_SEND
from server.config import Settings

log = logging.getLogger("server.app")


def create_app(settings: Settings, services: Services | None = None, *, exit_on_load_error: bool = False) -> FastAPI:
    """The app. Without `services` the lifespan loads the model in a thread (then /health -> 200),
    starts the engine and the TaskManager, and stops them at shutdown. With `services` (tests,
    embedding) it uses them as given and owns nothing."""
    owned = services is None
    services = services or Services(settings=settings)
    metrics = services.metrics = services.metrics or Metrics()
    services.extra.setdefault("prefix_cache", PrefixCache(prefix_budget(settings)))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.draining = asyncio.Event()
        app.state.loop = asyncio.get_running_loop()
        background = [asyncio.create_task(_http_stats_loop(services))]
        if owned:
            background.append(asyncio.create_task(_load(app, services, exit_on_load_error)))
        try:
            yield
        finally:
            app.state.draining.set()
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if owned:
                await _shutdown(services)

    app = ServerApp(title="RWKV-7 task server", version="0.1.0", lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    app.state.services = services
    app.state.load_error = None
    handlers.install(app)
    app.add_middleware(ServerMiddleware, max_body_bytes=settings.max_body_bytes,
                       api_keys=settings.api_key_set(), metrics=metrics)
    _include_routes(app)
    return app


class RawSendLayer:
    """The outermost ASGI layer: keeps the server's own `send` in the scope, so a streaming
    response can send its body messages without the middleware hops (see server.api.sse)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await self.app(scope, receive, send)


class ServerApp(FastAPI):
    def build_middleware_stack(self) -> Any:
        return RawSendLayer(super().build_middleware_stack())


def begin_drain(app: FastAPI) -> None:
    """Shutdown has begun: /health turns 503, open streams end with a `shutting_down` error event
    and waiting non-streaming requests get 503 (their sequences are aborted). Thread-safe."""
    ev, loop = getattr(app.state, "draining", None), getattr(app.state, "loop", None)
    if ev is not None and loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(ev.set)


def _include_routes(app: FastAPI) -> None:
    import server.webui
    from server.api import openai_routes, ops_routes, tasks_routes

    app.include_router(ops_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(tasks_routes.router)
    app.include_router(server.webui.router)


async def _load(app: FastAPI, services: Services, exit_on_error: bool) -> None:
    """Load the model in a thread, then start the TaskManager; /health turns 200 at the end."""
    settings = services.settings
    try:
        loaded = await asyncio.to_thread(load_services, settings)
        for name in ("model", "tokenizer", "engine", "model_id"):
            setattr(services, name, getattr(loaded, name))
        services.extra.update(loaded.extra)
        services.tasks = await _start_tasks(services)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001
        expected = isinstance(exc, (OSError, ValueError, KeyError)) or type(exc).__name__ == "CheckpointError"
        log.error("loading failed: %s: %s", type(exc).__name__, exc, exc_info=not expected)
        app.state.load_error = f"{type(exc).__name__}: {exc}"
        if exit_on_error:  # the CLI sets on_fatal (a clean uvicorn exit, status 1); else SIGTERM
            on_fatal = getattr(app.state, "on_fatal", None)
            on_fatal() if on_fatal else os.kill(os.getpid(), signal.SIGTERM)
        return
    services.ready = True
    for line in facts(services):
        log.info("%s", line)
    log.info("ready: listening on http://%s:%s", settings.host, settings.port)


async def _start_tasks(services: Services):
    from server.tasks import TaskManager

    # task runs count in the TTFT / inter-token / duration histograms, as OpenAI requests do
    tasks = TaskManager(services.engine, services.tokenizer, services.settings, services.model.shape,
                        latency=lambda: Recorder(services.metrics, time.perf_counter()))
    await tasks.start()
    return tasks


async def _shutdown(services: Services) -> None:
    services.ready = False
    if services.tasks is not None:
        try:
            await services.tasks.close()
        except Exception:  # noqa: BLE001
            log.exception("task manager close failed")
    if services.engine is not None:
        await asyncio.to_thread(services.engine.shutdown)
    log.info("shut down")


async def _http_stats_loop(services: Services) -> None:
    """The HTTP-side stats line: requests answered, 5xx, streams open (every stats_interval s)."""
    interval = services.settings.stats_interval
    if interval <= 0:
        return
    last_total, t_last = 0, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        total, errors = services.metrics.http_totals()
        now = time.monotonic()
        if total != last_total or services.metrics.streams_open:
            log.info("http: %.1f req/s, %d requests, %d 5xx, %d streams open",
                     (total - last_total) / (now - t_last), total, errors, services.metrics.streams_open)
        last_total, t_last = total, now
