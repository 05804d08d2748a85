"""POST /v1/chat/completions, the path rwkv_lightning's V1 batch shares with the OpenAI chat route:
one route (under OpenAI's tag), whose body is `ChatOrContents` (schemas.chat_kind decides). A body
with `contents` and no `messages` is lightning's batch (batch.contents, its credential may be the
body's `password`); any other is an OpenAI chat request, which needs the header's key and goes to
the OpenAI chat handler (server.api.openai.routes.chat_completions).

The route is lightning's because the sharing is: the OpenAI package knows nothing of lightning,
and lightning depends on it here, as on its OpenAI-style route (test/test_import_layers.py checks
that direction). The app includes this router beside the OpenAI one (server.api.app).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.lightning import batch
from server.api.lightning.auth import CredentialFirst, require_header_key
from server.api.lightning.schemas import ChatOrContents
from server.api.openai import routes as openai_routes
from server.api.openai.schemas import ChatRequest
from server.api.openapi import answers

router = APIRouter(prefix="/v1", tags=["openai"], route_class=CredentialFirst)  # a lightning body: key first


@router.post("/chat/completions", responses=answers(400, 401, 404, 409, 413, 429, 503, stream=True, lightning=True))
async def chat_completions(body: ChatOrContents, request: Request) -> Response:
    """An OpenAI chat request; a body with `contents` (and no `messages`) is rwkv_lightning's
    batch completion (server.api.lightning), whose credential may be the body's `password`."""
    if not isinstance(body, ChatRequest):
        return await batch.contents(body, request, answer_id="rwkv7-batch")
    require_header_key(request)
    return await openai_routes.chat_completions(body, request)
