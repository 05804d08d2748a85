"""The rwkv_lightning routes, for the auth middleware (server.api.middleware).

rwkv_lightning's clients send their credential as `password` in the JSON body (its OpenAI-style
route also takes `Authorization: Bearer`). On these POST paths the middleware lets a request
without a valid header through, marked, and the route checks the body's `password` against the
API keys (server.api.lightning.auth); every other path needs the header as before.
"""

from __future__ import annotations

SHARED_PATH = "/v1/chat/completions"
"""Shared with the OpenAI chat (one route: server.api.lightning.v1_chat): a `messages` body still needs the header."""

BODY_KEY_PATHS = frozenset(
    {
        SHARED_PATH,
        "/v2/chat/completions",
        "/translate/v1/batch-translate",
        "/FIM/v1/batch-FIM",
        "/big_batch/completions",
        "/state/chat/completions",
        "/multi_state/chat/completions",
        "/state/status",
        "/state/delete",
        "/openai/v1/chat/completions",
    }
)
"""POST paths whose credential may be the body's `password`."""

KEY_PATHS = BODY_KEY_PATHS | {"/openai/v1/models"}
"""Every lightning path: each needs an API key when keys are configured (those outside /v1 too)."""
