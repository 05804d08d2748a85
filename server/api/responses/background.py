"""POST /v1/responses/{response_id}/cancel: stop a background response (`background: true`).

A background response's run belongs to no request (server.api.responses.routes answers its create
at once, or streams it without stopping it when the client leaves): it ends by itself, by this
cancel, or by the server's stop (then "failed", as any interrupted response). As OpenAI's:
- only a response created with `background: true` can be cancelled: another is a 400 naming
  `response_id` (a foreground response stops when its request leaves), and nothing changes;
- a running one is stopped, and the answer is the response once settled: `cancelled`, with what
  was generated (its conversation, if any, gets no items from it, as from any cancelled response);
- one already ended is answered as it stands (a second cancel, or a cancel after the end, is no
  error).
A response another server runs is a 409 naming that server (as a task's stop).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.errors import ApiError
from server.api.openapi import answers
from server.api.responses import render
from server.api.responses.access import call, stored
from server.api.services import get_owner, get_services, json_response, task_manager

router = APIRouter(prefix="/v1", tags=["responses"])


@router.post("/responses/{response_id}/cancel", responses=answers(400, 401, 404, 409, 503))
async def cancel_response(response_id: str, request: Request) -> Response:
    sv, owner = get_services(request), get_owner(request)
    tm = task_manager(sv)
    t = await stored(tm, response_id, owner, "response_id")
    if not render.meta(t).get("background"):
        raise ApiError(
            400,
            f"response {response_id!r} was not created with background: true, and only a background response can "
            "be cancelled (a foreground response stops when the client that asked for it disconnects)",
            param="response_id",
            code="invalid_request",
        )
    if t.running:
        t = await call(tm.stop(t.id, owner))
    return json_response(render.response(t, sv.model_id, tokenizer=sv.tokenizer))
