"""OpenAI-compatible routes: /v1/completions, /v1/models, and the chat handler of
/v1/chat/completions (`chat_completions`). That path is shared with rwkv_lightning's V1 batch (a
body with `contents`), so its route is the one that shares it, server.api.lightning.v1_chat, which
hands an OpenAI body here: this package imports nothing of lightning."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.errors import ApiError, prompt_too_long
from server.api.generation.jobs import Job, Prompt, abort_all, collect, submit_all
from server.api.generation.stream import ChoiceStream, Renderer
from server.api.latency import Recorder
from server.api.openai import agent_render, render, start, tools
from server.api.openai.agents import Agent, chat_agent, chat_ready, completion_agent
from server.api.openai.chat_format import CHAT_STOP, build_prompt
from server.api.openai.messages import turns
from server.api.openai.schemas import ChatRequest, CompletionRequest, OpenAIFields
from server.api.openapi import answers
from server.api.services import Services, get_owner, get_services, json_response
from server.api.streaming.sse import SSEResponse
from server.engine.types import SamplingParams
from server.tasks.params import fim_prompt

router = APIRouter(prefix="/v1", tags=["openai"])
_STARTED = int(time.time())
ENCODE_INLINE_CHARS = 16_384


async def encode(sv: Services, text: str) -> list[int]:
    """Tokenize; long texts in a worker thread so the event loop keeps serving."""
    if len(text) < ENCODE_INLINE_CHARS:
        return sv.tokenizer.encode(text)
    return await asyncio.to_thread(sv.tokenizer.encode, text)


# (A trailing slash, `/v1/models/`, answers as the plain path: server.api.app.RawSendLayer.)
@router.get("/models", responses=answers(401, 503))
async def list_models(request: Request) -> Response:
    sv = get_services(request)
    return json_response({"object": "list", "data": [_model_card(sv)]})


@router.get("/models/{model_id:path}", responses=answers(401, 404, 503))
async def get_model(model_id: str, request: Request) -> Response:
    sv = get_services(request)
    if model_id != sv.model_id:
        raise ApiError(
            404,
            f"model {model_id!r} not found; this server serves {sv.model_id!r}",
            param="model",
            code="model_not_found",
        )
    return json_response(_model_card(sv))


def _model_card(sv: Services) -> dict[str, Any]:
    return {"id": sv.model_id, "object": "model", "created": _STARTED, "owned_by": "rwkv-server"}


def _checked(body: OpenAIFields, sv: Services, extra_stop: tuple[str, ...] = ()) -> list[SamplingParams]:
    """The request's SamplingParams per choice (choice i samples with seed + i), checked before
    anything is submitted: a refused field or a bad value is a 400 naming it, and so is a request
    with more sequences than the queue can ever hold (a 429 would send it back forever)."""
    refused = body.unsupported()
    if refused is not None:
        raise ApiError(400, refused[1], param=refused[0], code="unsupported_field")
    st = sv.settings
    p = body.sampling_params(sv.shape.vocab_size, st.default_max_tokens, st.max_tokens_limit)
    sequences = body.choices * body.prompt_count()
    if st.max_queue and sequences > st.max_queue:
        per = f"n={body.choices} x {body.prompt_count()} prompts" if body.prompt_count() > 1 else f"n={body.choices}"
        raise ApiError(
            400,
            f"this request needs {sequences} sequences ({per}) but at most max_queue="
            f"{st.max_queue} can wait at once, so it could never be accepted; ask for fewer",
            param="n",
            code="too_many_sequences",
        )
    if extra_stop:
        p = dataclasses.replace(p, stop=tuple(dict.fromkeys(p.stop + extra_stop)))
    if p.seed is None:
        return [p] * body.choices
    return [dataclasses.replace(p, seed=(p.seed + i) % 2**63) for i in range(body.choices)]


def _check_length(sv: Services, n_tokens: int, param: str = "messages") -> None:
    limit = sv.settings.max_prompt_tokens
    if n_tokens > limit:
        raise prompt_too_long(param, n_tokens, limit)


_GENERATES = answers(400, 401, 404, 409, 413, 429, 503, stream=True)  # 404 / 409: an unknown `state`, one not ready


async def chat_completions(body: ChatRequest, request: Request) -> Response:
    """An OpenAI chat request (its route checked the header's key): the handler of POST
    /v1/chat/completions, whose route is server.api.lightning.v1_chat's (see the module's doc)."""
    t0 = time.perf_counter()
    sv = get_services(request)
    params = _checked(body, sv, CHAT_STOP)
    agent = chat_agent(body)
    prompt = build_prompt(turns(body.messages, agent.described), sv.few_shot() if body.few_shot else "")
    if not prompt.continues:  # the reply's leading whitespace is not shown: no stop string matches in it
        params = [dataclasses.replace(p, hidden_lead=True) for p in params]
    agent = await chat_ready(sv, agent, new_turn=not prompt.continues)  # a constrained reply: the gap too
    params = agent.apply(params)
    suffix = agent.tool_plan.prompt_suffix() if agent.tool_plan is not None else ""
    prompt.rest += suffix
    rest = await start.encode_chat(sv, prompt.rest)
    prefix_tokens = await encode(sv, prompt.prefix) if prompt.prefix else []
    _check_length(sv, len(prefix_tokens) + len(rest))
    owner = get_owner(request)
    base = await start.resolve_base(sv, body.state, owner)
    reply = max(p.max_tokens for p in params)
    ongoing = any(m.role == "assistant" for m in body.messages)
    begun = await start.begin(  # (ClientGone: the client left during a prefill; answered 499)
        sv,
        owner,
        base,
        prefix_tokens + rest,
        (prompt.prefix, prefix_tokens),
        reply_tokens=reply,
        ongoing=ongoing,
        request=request,
    )
    n_prompt = len(prefix_tokens) + len(rest)
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    jobs = submit_all(
        sv.engine,
        [(begun.submit, begun.state, n_prompt)] * len(params),
        params,
        cid,
        return_state=begun.keep,
        max_queue=sv.settings.max_queue,
    )
    plan, plain = agent.tool_plan, prompt.rest[: len(prompt.rest) - len(suffix)]
    resent = str.lstrip if plan is None else partial(tools.resent_text, mode=plan.mode)
    begun.track(sv, jobs, start.chat_expect(sv, begun, plain, len(rest), resent))
    meta = render.Meta(
        id=cid,
        model=sv.model_id,
        created=int(time.time()),
        prompt_tokens=n_prompt,
        cached_tokens=begun.cached,
        continues=prompt.continues,
    )
    if agent.any:
        ex = agent_render.Extras(sv.tokenizer, agent.tool_plan, agent.logprobs)
        return await _respond(
            request, sv, body, jobs, meta, t0, agent_render.chat_renderer(ex), agent_render.chat_response(ex)
        )
    return await _respond(request, sv, body, jobs, meta, t0, render.chat_renderer, render.chat_response)


async def _completion_prompts(body: CompletionRequest, sv: Services) -> list[tuple[list[int], str]]:
    """[(tokens, text for echo)] for each prompt in the request."""
    p = body.prompt
    if isinstance(p, str):
        items: list[Any] = [p]
    elif isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    out = []
    vocab = sv.shape.vocab_size
    for item in items:
        if isinstance(item, str):
            text = fim_prompt(item, body.suffix) if body.suffix else item
            out.append((await encode(sv, text), item))
            continue
        bad = [t for t in item if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside [0, {vocab})", param="prompt", code="invalid_request")
        out.append((list(item), sv.tokenizer.decode(item)))
    for tokens, _ in out:
        if not tokens:
            raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_request")
        _check_length(sv, len(tokens), "prompt")
    return out


@router.post("/completions", responses=_GENERATES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    t0 = time.perf_counter()
    sv = get_services(request)
    agent = await completion_agent(sv, body)
    per_choice = agent.apply(_checked(body, sv))
    prompts = await _completion_prompts(body, sv)
    owner = get_owner(request)
    base = await start.resolve_base(sv, body.state, owner)
    seqs: list[Prompt] = []
    params: list[SamplingParams] = []
    echoes: list[str] = []
    reply = max(p.max_tokens for p in per_choice)
    starts = await asyncio.gather(*(_begin(request, base, tokens, agent, reply) for tokens, _ in prompts))
    for begun, (tokens, text) in zip(starts, prompts, strict=True):
        for p in per_choice:
            seqs.append((begun.submit, begun.state, len(tokens)))
            params.append(p)
            echoes.append(text if body.echo else "")
    cid = f"cmpl-{uuid.uuid4().hex}"
    keeps = [b.keep for b in starts for _ in per_choice]
    jobs = submit_all(sv.engine, seqs, params, cid, return_state=keeps, max_queue=sv.settings.max_queue)
    k, texts = len(per_choice), body.text_prompts()
    for i, (begun, (tokens, text)) in enumerate(zip(starts, prompts, strict=True)):  # FIM: not re-sent
        expect = start.completion_expect(sv, begun, text if texts and not body.suffix else None, len(tokens))
        begun.track(sv, jobs[i * k : (i + 1) * k], expect)
    meta = render.Meta(
        id=cid,
        model=sv.model_id,
        created=int(time.time()),
        prompt_tokens=sum(len(t) for t, _ in prompts),
        echoes=echoes,
        cached_tokens=sum(b.cached for b in starts),
    )
    if agent.logprobs is not None:
        scored = [tokens for tokens, _ in prompts for _ in per_choice] if agent.prompt_logprobs is not None else []
        ex = agent_render.Extras(sv.tokenizer, logprobs=agent.logprobs, prompts=scored)
        return await _respond(
            request,
            sv,
            body,
            jobs,
            meta,
            t0,
            agent_render.completion_renderer(ex),
            agent_render.completion_response(ex),
        )
    return await _respond(request, sv, body, jobs, meta, t0, render.completion_renderer, render.completion_response)


async def _begin(request: Request, base: start.Base, tokens: list[int], agent: Agent, reply: int) -> start.Start:
    """A prompt's start. Scoring the prompt (echo + logprobs) needs its every token fed, so
    it starts from the base, not from a kept conversation state."""
    if agent.prompt_logprobs is None:
        sv, owner = get_services(request), get_owner(request)
        return await start.begin(sv, owner, base, tokens, reply_tokens=reply, request=request)
    stream = base.tokens + list(tokens)
    return start.Start(stream=stream, submit=stream, state=base.state, cached=0, part=None)


async def _respond(
    request: Request,
    sv: Services,
    body: OpenAIFields,
    jobs: list[Job],
    meta: render.Meta,
    t0: float,
    renderer: Callable[[list[Job], render.Meta, bool], Renderer],
    full: Callable[[list[Job], render.Meta], dict[str, Any]],
) -> Response:
    """The SSE stream or, once every job is done, the whole JSON response. When the answer
    cannot be made, the jobs are aborted before the error goes out: nothing runs for a request
    that failed (a stream, once made, aborts them itself when it ends early)."""
    try:
        recorder = Recorder(sv.metrics, t0)
        if body.stream:
            source = ChoiceStream(jobs, renderer(jobs, meta, body.include_usage()), recorder)
            return SSEResponse(source, metrics=sv.metrics, direct=sv.settings.direct_stream)
        await collect(request, jobs, recorder)  # (ClientGone: the client left; answered 499)
        return json_response(full(jobs, meta))
    except BaseException:
        abort_all(jobs)
        raise


__all__ = ["router"]
