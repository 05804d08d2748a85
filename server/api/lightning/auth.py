"""Who a lightning request is: the API key from `Authorization: Bearer` (checked by the
middleware) or from the body's `password` (rwkv_lightning's credential, checked here). With API
keys configured, the credential is checked before anything else happens, the body's own checks
included: the lightning routers' routes are `CredentialFirst` routes, which read `password` from
the raw body before FastAPI validates it. Without keys there is nothing to check (owner None, as
on every route)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from server.api.api_keys import match_key
from server.api.errors import ApiError
from server.api.lightning.errors import UNAUTHORIZED, LightningError
from server.api.lightning.paths import SHARED_PATH
from server.api.lightning.schemas import chat_kind
from server.api.middleware import API_KEYS, KEY_DEFERRED
from server.api.services import get_owner


def authorize(request: Request, password: str | None) -> str | None:
    """The caller's API key (None: the server has no keys). A valid header was accepted by the
    middleware; otherwise `password` must be one of the keys: 401 in lightning's shape if not."""
    if getattr(request.state, KEY_DEFERRED, None) is None:
        return get_owner(request)
    owner = match_key(getattr(request.state, API_KEYS), password)
    if owner is None:
        raise LightningError(401, UNAUTHORIZED, headers={"www-authenticate": "Bearer"})
    request.state.owner = owner
    setattr(request.state, KEY_DEFERRED, None)  # checked: a later authorize() just names the owner
    return owner


async def authorize_body(request: Request) -> None:
    """authorize() with the raw JSON body's `password` (None when there is no JSON object or no
    string there), for a request without a valid header; an OpenAI body on the path it shares
    with lightning needs the header. The body is parsed as FastAPI parses it, and Starlette keeps
    the result, so it is parsed once."""
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deeply
        body = None
    if request.scope.get("path") == SHARED_PATH and chat_kind(body) == "ChatRequest":
        require_header_key(request)
    password = body.get("password") if isinstance(body, dict) else None
    authorize(request, password if isinstance(password, str) else None)


class CredentialFirst(APIRoute):
    """A lightning route: the credential is checked before FastAPI validates the body, so with
    API keys set a request without a valid key is a 401 whatever its body holds (a missing field,
    a bad value, no JSON at all), and nothing of it runs. (It acts only on the requests the
    middleware let through without a valid header: the POST paths of paths.BODY_KEY_PATHS.)"""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if getattr(request.state, KEY_DEFERRED, None) is not None:
                await authorize_body(request)
            return await handler(request)

        return checked


def require_header_key(request: Request) -> None:
    """For an OpenAI body on a path shared with lightning (POST /v1/chat/completions): the
    header's key was missing or wrong, so it is refused as the middleware refuses any /v1 request."""
    why = getattr(request.state, KEY_DEFERRED, None)
    if why is not None:
        raise ApiError(401, why, code="invalid_api_key", headers={"www-authenticate": "Bearer"})
