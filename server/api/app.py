"""The FastAPI application: lifespan (load in a thread, start engine + tasks), routes, middleware."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api import handlers, openapi
from server.api.latency import Recorder
from server.api.loading import Loaded, facts, load_services, prefix_budget
from server.api.metrics import Metrics
from server.api.middleware import ServerMiddleware
from server.api.openai.conversation import ConversationCache
from server.api.openai.conversation import metric_lines as conversation_metric_lines
from server.api.openai.prefix_cache import PrefixCache
from server.api.services import Services
from server.api.streaming.sse import RAW_SEND
from server.config import Settings, redact_url

log = logging.getLogger("server.app")
REPAIR_MIN_QUEUE = 8
"""Below this queue bound the conversation cache submits no background repairs: one could take
the place of a client's request for the moment it waits to be admitted."""


def create_app(settings: Settings, services: Services | None = None, *, exit_on_load_error: bool = False) -> FastAPI:
    """The app. Without `services` the lifespan loads the model in a thread (then /health -> 200),
    starts the engine and the TaskManager, and stops them at shutdown. With `services` (tests,
    embedding) it uses them as given and owns nothing."""
    owned = services is None
    metrics = services.metrics if services is not None else Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.draining = asyncio.Event()
        app.state.loop = asyncio.get_running_loop()
        background = [asyncio.create_task(http_stats_loop(metrics, settings.stats_interval))]
        if owned:
            background.append(asyncio.create_task(_load(app, settings, metrics, exit_on_load_error)))
        try:
            yield
        finally:
            app.state.draining.set()
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if owned and app.state.services is not None:
                await _shutdown(app.state.services)

    # /docs is ops.py's (FastAPI's page, plus an offline note)
    app = ServerApp(title="RWKV-7 task server", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.services = services  # None until loaded (routes answer 503 "loading")
    app.state.metrics = metrics
    app.state.load_error = None
    routes: list[BaseRoute] = []  # every route, flat: _include_routes fills it
    handlers.install(app)
    app.add_middleware(
        ServerMiddleware,
        max_body_bytes=settings.max_body_bytes,
        api_keys=settings.api_key_set(),
        metrics=metrics,
        raw_bodies=(("/v1/states/", settings.state_upload_bytes),),  # state file uploads
        access_log=settings.access_log,
        routes=routes,  # (filled below, once the routers are included)
    )
    origins = settings.cors_origin_list()
    if origins:  # outside the key check: a browser's preflight (OPTIONS) carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    routes.extend(_include_routes(app))
    openapi.install(app)
    return app


class RawSendLayer:
    """The outermost ASGI layer: keeps the server's own `send` in the scope, so a streaming
    response can send its body messages without the middleware hops (server.api.streaming.sse),
    and answers a path with trailing slashes (`/v1/tasks/create/`) as the plain path. Without
    that, the router answers such a path with a 307 redirect and an empty body, which most
    clients show as a bare error or do not follow for a POST. No route of this server ends in
    a slash but the root."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
            path: str = scope["path"]
            if len(path) > 1 and path.endswith("/"):
                scope["path"] = path.rstrip("/") or "/"
                raw = scope.get("raw_path")
                if raw:
                    scope["raw_path"] = raw.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)


class ServerApp(FastAPI):
    def build_middleware_stack(self) -> ASGIApp:
        return RawSendLayer(super().build_middleware_stack())


def begin_drain(app: FastAPI) -> None:
    """Shutdown has begun: /health turns 503, open streams end with a `shutting_down` error event
    and waiting non-streaming requests get 503 (their sequences are aborted). Thread-safe."""
    ev, loop = getattr(app.state, "draining", None), getattr(app.state, "loop", None)
    if ev is not None and loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(ev.set)


def _include_routes(app: FastAPI) -> list[BaseRoute]:
    """Include every router; returns their routes, flat (FastAPI's own list holds the included
    routers as a whole, which name no path)."""
    import server.webui
    from server.api import ops
    from server.api.lightning import routes as lightning_routes
    from server.api.lightning import v1_chat
    from server.api.openai import routes as openai_routes
    from server.api.responses import background, compact, conversation_routes
    from server.api.responses import routes as responses_routes
    from server.api.states import routes as states_routes
    from server.api.tasks import routes as tasks_routes

    routers = (
        ops.router,
        openai_routes.router,
        v1_chat.router,  # POST /v1/chat/completions: OpenAI's chat or lightning's V1 batch
        responses_routes.router,
        background.router,  # POST /v1/responses/{response_id}/cancel
        compact.router,  # POST /v1/responses/compact
        conversation_routes.router,
        tasks_routes.router,
        lightning_routes.router,
        states_routes.router,
        server.webui.router,
    )
    for router in routers:
        app.include_router(router)
    return list(_flat([route for router in routers for route in router.routes]))


def _flat(routes: list[BaseRoute]) -> Iterator[BaseRoute]:
    """routes with the routes of the routers included in them (no include here has a prefix);
    FastAPI >= 0.16x keeps an included router whole, as one route that names no path."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        yield from _flat(inner.routes) if inner is not None else (route,)


async def _load(app: FastAPI, settings: Settings, metrics: Metrics, exit_on_error: bool) -> None:
    """Load the model in a thread, then start the TaskManager; /health turns 200 at the end."""
    try:
        app.state.load_stage = "model"  # what failed, for the CLI's last line (cli.load_failure)
        loaded = await asyncio.to_thread(load_services, settings)
        services = await _start(app, loaded, settings, metrics)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        expected = isinstance(exc, (OSError, ValueError, KeyError)) or type(exc).__name__ == "CheckpointError"
        log.error("loading failed: %s: %s", type(exc).__name__, exc, exc_info=not expected)
        app.state.load_error = redact_url(f"{type(exc).__name__}: {exc}")  # shown by /health
        # a start refused as the CLI's checks refuse one (found only now: e.g. a name in use)
        app.state.load_refusal = str(exc) if getattr(exc, "refusal", False) else None
        if exit_on_error:  # the CLI sets on_fatal (a clean uvicorn exit, status 1); else SIGTERM
            on_fatal = getattr(app.state, "on_fatal", None)
            on_fatal() if on_fatal else os.kill(os.getpid(), signal.SIGTERM)
        return
    app.state.services = services
    for line in facts(services):
        log.info("%s", line)
    log.info("ready: listening on %s", settings.listen_url(getattr(app.state, "bound_port", None)))


async def _start(app: FastAPI, loaded: Loaded, settings: Settings, metrics: Metrics) -> Services:
    """The TaskManager over the loaded engine, and the Services the routes use. The engine is
    shut down if the task manager cannot start."""
    from server.api.states.startup import load_state_files
    from server.tasks import TaskManager

    try:
        # task runs count in the TTFT / inter-token / duration histograms, as OpenAI requests do
        tasks = TaskManager(
            loaded.engine,
            loaded.tokenizer,
            settings,
            loaded.shape,
            latency=lambda: Recorder(metrics, time.perf_counter()),
        )
        app.state.load_stage = "task database"
        await tasks.start()
        try:
            app.state.load_stage = "state files"
            await load_state_files(tasks, settings, loaded.shape)
        except BaseException:
            await tasks.close()
            raise
    except BaseException:
        await asyncio.to_thread(loaded.engine.shutdown)
        raise
    conversations = None
    if settings.conversation_cache_bytes > 0:
        conversations = ConversationCache(
            settings.conversation_cache_bytes,
            shared=settings.conversation_cache_shared,
            min_tokens=settings.conversation_cache_min_tokens,
            repairs=not 0 < settings.max_queue < REPAIR_MIN_QUEUE,
        )
        metrics.add_source(conversations.metric_lines)
    else:
        metrics.add_source(partial(conversation_metric_lines, {}))
    return Services(
        settings=settings,
        engine=loaded.engine,
        tokenizer=loaded.tokenizer,
        shape=loaded.shape,
        metrics=metrics,
        prefix_cache=PrefixCache(prefix_budget(settings)),
        tasks=tasks,
        model_id=loaded.model_id,
        facts=loaded.facts,
        conversations=conversations,
    )


async def _shutdown(services: Services) -> None:
    if services.conversations is not None:
        await services.conversations.close()
    if services.tasks is not None:
        try:
            await services.tasks.close()
        except Exception:
            log.exception("task manager close failed")
    await asyncio.to_thread(services.engine.shutdown)
    log.info("shut down")


async def http_stats_loop(metrics: Metrics, interval: float) -> None:
    """The HTTP-side stats line (requests answered, 5xx, streams open), every `interval` seconds
    in which something happened: monitoring probes alone (/health, /metrics) are no activity, so
    an idle server stays quiet."""
    if interval <= 0:
        return
    last_total, t_last = metrics.http_totals()[0], time.monotonic()
    while True:
        await asyncio.sleep(interval)
        total, errors = metrics.http_totals()
        now = time.monotonic()
        if total != last_total or metrics.streams_open:
            log.info(
                "http: %.1f req/s, %d requests, %d 5xx, %d streams open",
                (total - last_total) / (now - t_last),
                total,
                errors,
                metrics.streams_open,
            )
        last_total, t_last = total, now
