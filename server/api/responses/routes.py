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

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from server.api.errors import ApiError, engine_error, prompt_too_long, task_error
from server.api.openai.chat_format import CHAT_STOP
from server.api.openapi import RESPONSES_EVENTS, answers
from server.api.responses import agent, compaction, conversation, joins, logprobs, render
from server.api.responses.checks import check_input, check_supported
from server.api.responses.items import page
from server.api.responses.schemas import ResponseInput, ResponseRequest
from server.api.responses.stream import ResponseStream
from server.api.services import Services, end_run, get_owner, get_services, json_response, task_manager
from server.api.streaming.sse import SSEResponse
from server.api.streaming.watch import done_or_gone
from server.engine.types import EOS_TOKEN, EngineError, PromptTooLongError, SamplingParams
from server.tasks.errors import TaskElsewhere, TaskError, TaskNotFound

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

router = APIRouter(prefix="/v1", tags=["responses"])
T = TypeVar("T")


async def call(aw: Awaitable[T]) -> T:
    """Task-layer and engine errors -> ApiError (a bad value is a 400, as on the OpenAI routes).
    The task's prompt is this route's `input`: an error about it names `input`."""
    try:
        return await aw
    except TaskError as exc:
        raise _task_error(exc) from None
    except (EngineError, ValueError) as exc:
        if isinstance(exc, PromptTooLongError):
            raise prompt_too_long("input", exc.tokens, exc.limit) from None
        err = engine_error(exc)
        err.param = "input" if err.param == "prompt" else err.param
        raise err from None


def _task_error(exc: TaskError) -> ApiError:
    """errors.task_error, with a bad value as the OpenAI routes' 400 and `prompt` named `input`;
    a response another server runs named as the response."""
    err = task_error(exc, param="input" if exc.param == "prompt" else exc.param)
    if err.status == 422:
        err.status = 400
    if isinstance(exc, TaskElsewhere) and exc.task_id.startswith("TASK_"):
        rid, err.param = render.response_id_of(exc.task_id), "response_id"
        err.message = f"response {rid} is running on {exc.where}; send this request there"
    return err


async def stored(tm: TaskManager, rid: str, owner: str | None, param: str | None = None) -> Task:
    """The task of a stored response `owner` may see; 404 otherwise (unknown, another key's)."""
    tid = render.task_id(rid)
    try:
        if tid is None:
            raise TaskNotFound(rid)
        t = await tm.get(tid, owner)
        if not render.is_response(t):  # a /v1/tasks task or a lightning session: not ours
            raise TaskNotFound(rid)
        return t
    except TaskError as exc:
        if not isinstance(exc, TaskNotFound):
            raise _task_error(exc) from None
        raise _not_found(rid, param) from None


def _not_found(rid: str, param: str | None) -> ApiError:
    return ApiError(404, f"response {rid!r} not found (unknown, not stored, or another API key's)", param=param,
                    code="response_not_found")  # fmt: skip


def _params(sv: Services, body: ResponseRequest, fmt: dict[str, Any]) -> dict[str, Any]:
    """Every generation field, explicit: a response never inherits its previous one's."""
    d, limit = SamplingParams(), sv.settings.max_tokens_limit
    max_tokens = sv.settings.default_max_tokens if body.max_output_tokens is None else body.max_output_tokens
    if limit and max_tokens > limit:
        raise ApiError(
            400,
            f"invalid 'max_output_tokens': {max_tokens} is above this server's limit of {limit}",
            param="max_output_tokens",
            code="invalid_request",
        )
    out = {
        "max_tokens": max_tokens,
        "temperature": d.temperature if body.temperature is None else body.temperature,
        "top_p": d.top_p if body.top_p is None else body.top_p,
        "stop": list(CHAT_STOP),
        "response_format": fmt,
    }
    if body.seed is not None:
        out["seed"] = body.seed
    k = logprobs.requested(body.include, body.top_logprobs)
    if k is not None:
        out["logprobs"] = k
    return out


def separator(sv: Services, src: Task) -> str:
    """What goes between the previous response's history and the new turns: nothing after EOS
    or a turn break the model wrote, else the turn break."""
    tail = list(src.tokens[-2:])
    if not tail or tail[-1] == EOS_TOKEN or sv.tokenizer.decode(tail).endswith("\n\n"):
        return ""
    return "\n\n"


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
    params = {**_params(sv, body, fmt), **agent.task_params(rt, meta, fmt)}
    params["hidden_lead"] = not render.continues_prompt(prompt, params)
    if src is not None:
        prompt = separator(sv, src) + prompt
        made = tm.fork(src.id, params, prompt, tmp=not body.store, owner=owner, tag=render.RESPONSE, inherit=False)
    else:
        made = tm.create(prompt, params, persistent=body.store, owner=owner, tag=render.RESPONSE)
    t = await conversation.too_long(call(made), conv)  # (a whole history over the limit: says so)
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
            raise _not_found(body.previous_response_id, "previous_response_id") from None
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


async def previous(tm: TaskManager, rid: str, owner: str | None) -> Task:
    """The task of previous_response_id: 404 (not found), 409 (still running)."""
    src = await stored(tm, rid, owner, "previous_response_id")
    if src.running and not src.stop_requested:  # (a stopping one: the fork waits for its settle)
        raise ApiError(409, f"response {rid!r} is still in progress", param="previous_response_id",
                       code="response_in_progress")  # fmt: skip
    return src


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
        end_run(request, tm, t)
        request.state.error = "the client left before the answer"
        return Response(status_code=499)
    return json_response(render.response(t, sv.model_id, tokenizer=sv.tokenizer))


async def wait_end(request: Request, t: Task) -> bool:
    """Wait for the end of t's run: True once it ended, False when the client left first. 503
    when the server begins to shut down meanwhile (the caller stops the run)."""
    if not t.running or t.done is None:
        return True
    return await done_or_gone(request, t.done.wait())


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
