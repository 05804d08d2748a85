"""What routes need from the running server, reached through `request.app.state.services`.

The app (server/api/app.py) builds one `Services` once the model is loaded and the task manager
started (until then `app.state.services` is None and the routes answer 503 "loading"); tests and
embedders may pass their own. Routes use the small dependency functions below.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from server.api.errors import ApiError
from server.api.metrics import Metrics
from server.api.openai.chat_format import FewShotUnreadable, default_few_shot_path, load_few_shot
from server.api.openai.conversation import ConversationCache
from server.api.openai.prefix_cache import PrefixCache
from server.api.streaming.watch import draining
from server.config import Settings
from server.engine.protocol import EngineAPI
from server.tokenizer import Tokenizer

if TYPE_CHECKING:  # (imports torch at run time: only the type is needed here)
    from server.model.state import ModelShape
    from server.tasks import TaskManager
    from server.tasks.records import Task

log = logging.getLogger(__name__)


@dataclass
class LoadFacts:
    """What loading found out, for the start-up lines (server.api.loading.facts)."""

    seconds: float = 0.0
    device: str = ""
    kernel_modules: list[str] = field(default_factory=list)
    """Modules the model's WKV ops come from."""
    kernel_log: list[str] = field(default_factory=list)
    """The kernel loader's messages while loading (builds, cache loads, fallbacks)."""
    quant: str = "none"
    """The layers' linears' 8-bit mode: --quant's, or a pre-quantized checkpoint's own."""


@dataclass
class Services:
    settings: Settings
    engine: EngineAPI
    tokenizer: Tokenizer
    shape: ModelShape
    metrics: Metrics
    prefix_cache: PrefixCache
    tasks: TaskManager | None = None
    """None: the task routes answer 503 (an embedding without a task store)."""
    model_id: str = "rwkv7"
    facts: LoadFacts = field(default_factory=LoadFacts)
    conversations: ConversationCache | None = None
    """The OpenAI routes' conversation cache (None: off)."""
    _few_shot: str | None = field(default=None, init=False, repr=False)

    def few_shot(self) -> str:
        """The few-shot dialogue text (read once). A file that cannot be read (removed since the
        start-up check, or the default few_shot.txt missing) is the server's fault, not the
        request's: ApiError 500 `few_shot_unavailable` (tried again on the next request)."""
        if self._few_shot is None:
            path = self.settings.few_shot or default_few_shot_path()
            try:
                self._few_shot = load_few_shot(path)
            except FewShotUnreadable as why:
                log.error("few-shot file %s cannot be read (%s): requests asking for it answer 500", path, why)
                raise ApiError(500, f"the server cannot read its few-shot file {path} ({why}); see --few-shot",
                               code="few_shot_unavailable") from None  # fmt: skip
        return self._few_shot


def get_services(request: Request) -> Services:
    """The running server's services; 503 while loading or once the engine stopped."""
    services: Services | None = getattr(request.app.state, "services", None)
    if services is None:
        raise ApiError(503, "the model is still loading; retry shortly", code="loading", headers={"Retry-After": "5"})
    if not services.engine.is_alive:
        raise ApiError(503, "the inference engine stopped; see the server log", code="engine_dead")
    return services


def get_owner(request: Request) -> str | None:
    """The API key that made this request (None when the server has no keys).

    Set by the auth middleware; tasks belong to it."""
    return getattr(request.state, "owner", None)


def task_manager(sv: Services) -> TaskManager:
    """The task manager, for the routes that need one; 503 when the server runs without it."""
    if sv.tasks is None:
        raise ApiError(503, "the task manager is not running", code="tasks_unavailable")
    return sv.tasks


def end_run(request: Request, tasks: TaskManager, t: Task) -> None:
    """Stop t's run because its answer ended first: the client left ("stopped"), or the server
    began to shut down ("interrupted", as the shutdown ends every run: its state is kept and a
    continue goes on from it)."""
    if draining(request.app):
        tasks.interrupt(t)
    else:
        tasks.abort(t)


def json_response(body: dict[str, Any], status: int = 200) -> Response:
    """A JSON body (orjson) with its status."""
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")
