"""Who a lightning request is: the API key from `Authorization: Bearer` (checked by the
middleware) or from the body's `password` (rwkv_lightning's credential, checked here). With API
keys configured, every lightning route calls `authorize` before anything else happens; without
keys there is nothing to check (owner None, as on every route)."""

from __future__ import annotations

from fastapi import Request

from server.api.errors import ApiError
from server.api.lightning.errors import UNAUTHORIZED, LightningError
from server.api.middleware import API_KEYS, KEY_DEFERRED, match_key
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
    return owner


def require_header_key(request: Request) -> None:
    """For an OpenAI body on a path shared with lightning (POST /v1/chat/completions): the
    header's key was missing or wrong, so it is refused as the middleware refuses any /v1 request."""
    why = getattr(request.state, KEY_DEFERRED, None)
    if why is not None:
        raise ApiError(401, why, code="invalid_api_key", headers={"www-authenticate": "Bearer"})
