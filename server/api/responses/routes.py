"""/v1/responses: create (optionally continuing a previous response), get (the response, or with
`stream=true` its events again: stream.py), delete.

A response is a task of the task layer (server.tasks.TaskManager): `store: true` (the default)
makes a persistent task (in the database, so a chain survives a restart), `store: false` a TMP
task (never readable back). `previous_response_id` forks the previous response's task: the new
one starts from its state (the history is never prefilled again) and the previous response
stays readable; so does an input's compaction item its compaction's (compaction.py). The prompt
is the RWKV chat format (server.api.openai.chat_format).

A response is tied to its request (as OpenAI's non-background responses are): a client that
leaves before the answer's end, streamed or not, stops the run; a stored one keeps what was
generated (status "cancelled"). With `background: true` the create answers at once (or streams,
and a client that leaves stops nothing): GET reads it, POST .../cancel stops it (background.py).
Only tasks made here are responses (their tag: render.RESPONSE). Tools (function calls) as on
chat: agent.py; input items: items.py. `POST /v1/responses/input_tokens` counts the tokens a
create with the same prompt fields would take in (its usage.input_tokens), running nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from server.api.errors import ApiError
from server.api.generation.jobs import ClientGone
from server.api.openapi import RESPONSES_EVENTS, answers
from server.api.responses import agent, autocompact, compaction, conversation, joins, render, reuse
from server.api.responses.access import call, not_found, previous, separator, stored, wait_end
from server.api.responses.checks import check_input, check_supported
from server.api.responses.items import page
from server.api.responses.schemas import ResponseInput, ResponseRequest
from server.api.responses.stream import ResponseStream
from server.api.services import Services, end_run, get_owner, get_services, json_response, task_manager
from server.api.streaming.sse import SSEResponse
from server.tasks.errors import TaskNotFound

if TYPE_CHECKING:
    from server.tasks.records import Task

router = APIRouter(prefix="/v1", tags=["responses"])


@router.post("/responses", responses=answers(400, 401, 404, 409, 413, 429, 503, stream=True, events=RESPONSES_EVENTS))
async def create_response(body: ResponseRequest, request: Request) -> Response:
    sv, owner = get_services(request), get_owner(request)
    tm = task_manager(sv)
    check_supported(body)
    rt = agent.response_tools(body)
    fmt = agent.response_format(body)
    src = await compaction.resume(tm, body, owner)  # (input's last compaction item: refused beside the others)
    conv = await conversation.start(tm, body, owner)  # (check_input refused it beside previous_response_id)
    src = conv.head if conv is not None else src
    if body.previous_response_id:
        src = await previous(tm, body.previous_response_id, owner)
    prompt, meta = agent.prompt_and_meta(body, rt, src, conv)
    rt = await agent.ready(sv, rt, prompt)  # its grammar compiled (a new turn's format: behind the gap)
    sampling = agent.sampling_params(sv, body, fmt)  # (checked before a compaction is made)
    reused = await reuse.continued(sv, owner, src, conv, prompt, meta)  # (a history sent whole: an earlier one's)
    cut = await autocompact.cut(request, sv, body, rt, src, conv, prompt, meta, reused)  # (context_management)
    if cut is not None:
        src, prompt, reused = cut.task, cut.prompt, None
    params = {**sampling, **agent.task_params(rt, meta, fmt)}
    params["hidden_lead"] = not render.continues_prompt(prompt, params)
    if reused is not None:
        made = reuse.fork(tm, reused, params, store=body.store, owner=owner)
    elif src is not None:
        prompt = separator(sv, src) + prompt
        made = tm.fork(src.id, params, prompt, tmp=not body.store, owner=owner, tag=render.RESPONSE, inherit=False)
    else:
        made = tm.create(prompt, params, persistent=body.store, owner=owner, tag=render.RESPONSE)
    t = await conversation.too_long(autocompact.kept(sv, cut, call(made), owner), conv)  # (too long: says so)
    reuse.recent(tm).add(owner, t.id)
    try:
        if conv is not None:
            await conversation.begin(tm, conv, t, owner)
        return await _answer(request, sv, t, body.stream, bool(body.background))
    except BaseException:  # no answer (an error, the server cancelled the request): nothing runs on
        end_run(request, tm, t)
        raise


@router.post("/responses/input_tokens", responses=answers(400, 401, 404, 409, 503))
async def count_input_tokens(body: ResponseInput, request: Request) -> Response:
    """The tokens a response with these fields would take in, its `usage.input_tokens`: the
    previous responses' history, the tools' description, the instructions and the input, in the
    chat format. Nothing is created or run; a bad field is refused as on create."""
    sv, owner = get_services(request), get_owner(request)
    tm = task_manager(sv)
    check_input(body)
    rt = agent.response_tools(body)
    src = await compaction.resume(tm, body, owner)
    conv = await conversation.start(tm, body, owner, counting=True)
    if conv is not None:
        src = conv.head
    elif body.previous_response_id:  # one being stopped: counted once settled (create's fork waits too)
        try:
            src = await tm.settled(await previous(tm, body.previous_response_id, owner))
        except TaskNotFound:  # deleted meanwhile
            raise not_found(body.previous_response_id, "previous_response_id") from None
    prompt, _, _ = agent.prompt(body, rt, src, conv.items if conv is not None else ())
    await agent.ready(sv, rt, prompt)  # (a format the decoder cannot compile: refused as on create)
    history = 0
    if src is not None:
        prompt, history = separator(sv, src) + prompt, len(src.tokens)
    ids = await call(tm.inputs.encode(prompt))
    return json_response({"object": "response.input_tokens", "input_tokens": history + len(ids)})


# GET or DELETE of the count's or the compaction's path: no response id (a 405, not a 404 naming it)
@router.api_route("/responses/input_tokens", methods=["GET", "DELETE"], include_in_schema=False)
@router.api_route("/responses/compact", methods=["GET", "DELETE"], include_in_schema=False)
async def post_only(request: Request) -> Response:
    raise ApiError(405, f"method {request.method} is not allowed on {request.url.path} (POST only)",
                   code="method_not_allowed", headers={"Allow": "POST"})  # fmt: skip


async def _answer(request: Request, sv: Services, t: Task, stream: bool, background: bool) -> Response:
    """The stream of the run, or the response once it ended; either way a client that leaves
    first stops the run (SSEResponse aborts the source; _settle aborts the wait). In the
    background: the response at once (in progress), or a stream whose client may leave."""
    tm = task_manager(sv)
    if stream:
        stop, interrupt = (lambda: end_run(request, tm, t)), (lambda: tm.interrupt(t))
        source = ResponseStream(t, sv.model_id, on_abort=None if background else stop,
                                on_shutdown=interrupt if background else None, tokenizer=sv.tokenizer)  # fmt: skip
        return SSEResponse(source, metrics=sv.metrics, error_end=source.error_end)
    if background:  # (as OpenAI's answer: queued or in progress, no output yet; GET then shows it as it is)
        return json_response(render.head(t, sv.model_id, waiting=True))
    if not await wait_end(request, t):
        raise ClientGone()  # (answered 499; the create stops the run)
    return json_response(render.response(t, sv.model_id, tokenizer=sv.tokenizer))


# GET or DELETE `/v1/responses` (or `/v1/responses/`: RawSendLayer): a 404, not the router's 405
@router.api_route("/responses", methods=["GET", "DELETE"], include_in_schema=False)
async def no_response_id(request: Request) -> Response:
    raise ApiError(
        404,
        f"no route {request.method} {request.url.path}: the response id is missing "
        "(GET or DELETE /v1/responses/{response_id}; POST /v1/responses creates one)",
        param="response_id",
        code="not_found",
    )


@router.get("/responses/{response_id}", responses=answers(400, 401, 404, 503, stream=True, events=RESPONSES_EVENTS))
async def get_response(
    response_id: str,
    request: Request,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=0)] = None,
) -> Response:
    """The response; with `stream=true` its events (server.api.responses.stream), numbered as its
    own stream numbered them: a running response's from its start and on to its end, a finished
    one's replayed; `starting_after` sends those after that sequence number (a client that lost
    its stream resumes it). Reading it stops nothing: the run is its creating request's (a
    background response's: its own, background.py stops it)."""
    sv = get_services(request)
    tm, owner = task_manager(sv), get_owner(request)
    t = await stored(tm, response_id, owner, "response_id")
    if stream:  # a response another server runs streams there (409 naming it), as a task's does
        t = await call(tm.get(t.id, owner, stream=True))
        source = ResponseStream(t, sv.model_id, on_abort=None, starting_after=starting_after,
                                on_shutdown=lambda: tm.interrupt(t), tokenizer=sv.tokenizer)  # fmt: skip
        return SSEResponse(source, metrics=sv.metrics, error_end=source.error_end)
    return json_response(render.response(t, sv.model_id, tokenizer=sv.tokenizer))


@router.get("/responses/{response_id}/input_items", responses=answers(400, 401, 404, 503))
async def list_input_items(
    response_id: str,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> Response:
    """The items of the response's `input`, as OpenAI lists them (`include` is ignored: items carry
    no extra data here). A response stored before items were kept lists none."""
    sv = get_services(request)
    t = await stored(task_manager(sv), response_id, get_owner(request), "response_id")
    return json_response(page(render.meta(t).get("input") or [], limit, order, after))


@router.delete("/responses/{response_id}", responses=answers(401, 404, 409, 503))  # 409: running elsewhere
async def delete_response(response_id: str, request: Request) -> Response:
    sv, owner = get_services(request), get_owner(request)
    tm = task_manager(sv)
    t = await stored(tm, response_id, owner, "response_id")
    cid = render.meta(t).get("conversation")
    if cid and not t.running:  # its items join first (a deleted response's would not)
        try:
            await joins.settle(tm, cid, owner)
        except ApiError as exc:
            if exc.status != 404:  # (the conversation deleted: nothing to join)
                raise
    await call(tm.delete(t.id, owner))
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})
