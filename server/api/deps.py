"""What routes need from the running server, reached through `request.app.state.services`.

The app factory (server/api/app.py) fills a `Services` at start-up; routes use the small
dependency functions below, so tests can build an app around any engine/task manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from server.api.errors import ApiError
from server.config import Settings


@dataclass
class Services:
    settings: Settings
    model: Any = None  # server.model.RWKV7
    tokenizer: Any = None  # server.tokenizer.Tokenizer
    engine: Any = None  # server.engine.Engine
    tasks: Any = None  # server.tasks.TaskManager
    metrics: Any = None  # server.api.metrics.Metrics
    model_id: str = "rwkv7"
    ready: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def get_services(request: Request) -> Services:
    services: Services | None = getattr(request.app.state, "services", None)
    if services is None or not services.ready:
        raise ApiError(503, "the model is still loading; retry shortly", code="loading",
                       headers={"Retry-After": "5"})
    if services.engine is not None and not getattr(services.engine, "is_alive", True):
        raise ApiError(503, "the inference engine stopped; see the server log", code="engine_dead")
    return services


def get_owner(request: Request) -> str | None:
    """The API key that made this request (None when the server has no keys).

    Set by the auth middleware; tasks belong to it."""
    return getattr(request.state, "owner", None)
