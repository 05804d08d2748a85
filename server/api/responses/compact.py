"""POST /v1/responses/compact: a history prefilled into a compaction, OpenAI's
`response.compaction` object answered (what a compaction is here, and how a response resumes
one: server.api.responses.compaction).

The history is the state of `previous_response_id` (or of the input's last compaction item),
then `instructions` and the input's items, rendered as a response renders them, without the
"Assistant:" that would open a reply: the state ends where a response's would after its last
item. Nothing is generated; the answer comes once the prefill has ended. A client that leaves
first, or a prefill that fails, leaves no compaction behind. A create with context_management
compacts through `make` too (autocompact.py).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.errors import ApiError
from server.api.generation.jobs import ClientGone
from server.api.openai.chat_format import CHAT_STOP
from server.api.openapi import answers
from server.api.responses import agent, compaction, render
from server.api.responses.access import call, previous, separator, wait_end
from server.api.responses.checks import check_text
from server.api.responses.reuse import Reuse
from server.api.responses.schemas import CompactRequest, HistoryInput
from server.api.services import Services, end_run, get_owner, get_services, json_response, task_manager

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

router = APIRouter(prefix="/v1", tags=["responses"])
_NO_TOOLS = agent.ResponseTools(None, None, None)


@router.post("/responses/compact", responses=answers(400, 401, 404, 409, 413, 429, 503))
async def compact(body: CompactRequest, request: Request) -> Response:
    sv, owner = get_services(request), get_owner(request)
    tm = task_manager(sv)
    _check(body)
    src = await compaction.resume(tm, body, owner)
    if body.previous_response_id is not None:  # (one being stopped: once settled, as a count waits)
        src = await call(tm.settled(await previous(tm, body.previous_response_id, owner)))
    if src is None and not body.input and not body.instructions:
        raise ApiError(400, "nothing to compact: give input, or previous_response_id", param="input",
                       code="invalid_request")  # fmt: skip
    return json_response(compaction.compacted(await make(request, sv, body, _NO_TOOLS, src, owner)))


async def make(
    request: Request,
    sv: Services,
    body: HistoryInput,
    rt: agent.ResponseTools,
    src: Task | None,
    owner: str | None,
    reused: Reuse | None = None,
) -> Task:
    """The compaction of body's history after src's (its instructions and input, rendered with
    rt's tools described), prefilled and stored; `reused`: an earlier response whose history is
    the start of it (reuse.py): forked, with the rest. ClientGone when the client left first (the
    compaction is then deleted, as on any other failure)."""
    tm = task_manager(sv)
    text, rendered, described = agent.prompt(body, rt, src)
    text = text if render.continues_prompt(text, {}) else text.removesuffix("Assistant:")
    users = [*await compaction.users_of(tm, src, owner), *compaction.users(rendered.items)]
    params: dict[str, Any] = {"max_tokens": 0, "stop": list(CHAT_STOP), "meta": {
        "input": rendered.items, "calls": rendered.kept_calls(), "described": described,
        "instructions": body.instructions, "users": users}}  # fmt: skip
    base, text = src, (separator(sv, src) + text if src is not None and text else text)
    if reused is not None and len(reused.text) - len(reused.rest) <= len(text):  # (its history: text's start)
        base, text = reused.task, text[len(reused.text) - len(reused.rest) :]
    if base is None:
        made = tm.create(text, params, persistent=True, owner=owner, tag=compaction.new_tag())
    else:
        if not text:  # the fork names base's stored state: its latest (else a restart re-feeds the last turn)
            await tm.state_written(base)
        made = tm.fork(base.id, params, text or None, owner=owner, tag=compaction.new_tag(), inherit=False)
    t = await call(made)
    if not await _prefilled(request, sv, t, owner):
        raise ClientGone()
    return t


async def _prefilled(request: Request, sv: Services, t: Task, owner: str | None) -> bool:
    """Wait for t's prefill: True once it ended; False when the client left first. Unless True,
    t is stopped and deleted: 503 when the server begins to shut down meanwhile, 500 for a
    prefill that failed."""
    tm = task_manager(sv)
    try:
        ended = await wait_end(request, t)
        if ended and t.finish_reason == "interrupted":
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if ended and t.finish_reason not in ("length", "stop"):
            raise ApiError(500, f"the compaction's prefill failed: {t.out.error or t.finish_reason}",
                           code="server_error")  # fmt: skip
    except BaseException:
        end_run(request, tm, t)
        await drop(tm, t.id, owner)
        raise
    if not ended:
        end_run(request, tm, t)
        await drop(tm, t.id, owner)
    return ended


def _check(body: CompactRequest) -> None:
    check_text(body)
    if body.image is not None:
        raise ApiError(400, "image (no image input here) is not supported on /v1/responses/compact", param="image",
                       code="unsupported_field")  # fmt: skip


async def drop(tm: TaskManager, task_id: str, owner: str | None) -> None:
    """Delete a compaction that will not be answered (its run stopped first: the delete waits
    for it to settle)."""
    with contextlib.suppress(Exception):
        await tm.delete(task_id, owner)
