"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api import openai_stream as st
from server.api.chat_format import CHAT_STOP, build_prompt, default_few_shot_path, load_few_shot
from server.api.deps import Services, get_services
from server.api.direct import DirectStream
from server.api.errors import ApiError
from server.api.generation import ClientGone, Recorder, collect, engine_error, submit_all
from server.api.openai_schemas import ChatRequest, CompletionRequest, SamplingFields
from server.api.sse import SSEResponse
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


def _json(body: dict) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


@router.get("/models")
async def list_models(request: Request) -> Response:
    sv = get_services(request)
    return _json({"object": "list", "data": [_model_card(sv)]})


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Response:
    sv = get_services(request)
    if model_id != sv.model_id:
        raise ApiError(404, f"model {model_id!r} not found; this server serves {sv.model_id!r}",
                       param="model", code="model_not_found")
    return _json(_model_card(sv))


def _model_card(sv: Services) -> dict[str, Any]:
    return {"id": sv.model_id, "object": "model", "created": _STARTED, "owned_by": "rwkv-server"}


def sampling(body: SamplingFields, sv: Services, index: int, max_tokens: int | None,
             extra_stop: tuple[str, ...] = ()) -> SamplingParams:
    """OpenAI fields -> SamplingParams; absent fields take the server's (RWKV) defaults."""
    d = SamplingParams()
    pick = lambda v, default: default if v is None else v  # noqa: E731
    return SamplingParams(
        max_tokens=pick(max_tokens, sv.settings.default_max_tokens),
        temperature=pick(body.temperature, d.temperature),
        top_p=pick(body.top_p, d.top_p),
        top_k=max(0, pick(body.top_k, d.top_k)),
        presence_penalty=pick(body.presence_penalty, d.presence_penalty),
        repetition_penalty=pick(body.frequency_penalty, d.repetition_penalty),
        penalty_decay=pick(body.penalty_decay, d.penalty_decay),
        seed=None if body.seed is None else (body.seed + index) % 2**63,
        stop=tuple(dict.fromkeys(body.stop_list() + extra_stop)),
        ignore_eos=body.ignore_eos,
    )


def _check_length(sv: Services, n_tokens: int, param: str = "messages") -> None:
    limit = sv.settings.max_prompt_tokens
    if n_tokens > limit:
        raise ApiError(413, f"prompt has {n_tokens} tokens; the limit is {limit}", param=param,
                       code="prompt_too_long")


async def _prefix_state(sv: Services, prefix: str, tokens: list[int]) -> tuple[Any, list[int]]:
    """(state after the prefix, tokens still to feed before the rest) from the prefix cache."""
    if not prefix:
        return None, []
    try:
        entry = await sv.extra["prefix_cache"].get(sv.engine, tokens, prefix)
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise engine_error(exc) from exc
    return entry.state, entry.pending


def _few_shot(sv: Services) -> str:
    if "few_shot_text" not in sv.extra:
        path = sv.settings.few_shot or default_few_shot_path()
        try:
            sv.extra["few_shot_text"] = load_few_shot(path)
        except OSError as exc:
            raise ApiError(400, f"this server has no few-shot file ({exc})", param="few_shot") from None
    return sv.extra["few_shot_text"]


def _refuse_chat_extras(body: ChatRequest) -> None:
    if body.tools or body.functions:
        raise ApiError(400, "tools / function calling are not supported", param="tools")
    if body.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
        raise ApiError(400, f"response_format {fmt!r} is not supported (text only)", param="response_format")


def _messages(body: ChatRequest) -> list[tuple[str, str]]:
    out = []
    for i, m in enumerate(body.messages):
        try:
            out.append((m.role, m.text()))
        except ValueError as exc:
            raise ApiError(400, str(exc), param=f"messages[{i}].content") from None
    return out


@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    t0 = time.perf_counter()
    sv = get_services(request)
    _refuse_chat_extras(body)
    prompt = build_prompt(_messages(body), _few_shot(sv) if body.few_shot else "")
    rest = await encode(sv, prompt.rest)
    prefix_tokens = await encode(sv, prompt.prefix) if prompt.prefix else []
    _check_length(sv, len(prefix_tokens) + len(rest))
    init_state, pending = await _prefix_state(sv, prompt.prefix, prefix_tokens)
    n_prefix, rest = len(prefix_tokens), pending + rest
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = [sampling(body, sv, i, max_tokens, CHAT_STOP) for i in range(body.n)]
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    n_prompt = n_prefix + len(rest) - len(pending)
    jobs = submit_all(sv.engine, [(rest, init_state, n_prompt)] * body.n, params, cid)
    meta = st.Meta(id=cid, model=sv.model_id, created=int(time.time()), prompt_tokens=n_prompt)
    return await _respond(request, sv, body, jobs, meta, t0, st.chat_parts, st.chat_response)


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
    vocab = sv.model.shape.vocab_size
    for i, item in enumerate(items):
        if isinstance(item, str):
            text = fim_prompt(item, body.suffix) if body.suffix else item
            out.append((await encode(sv, text), item))
            continue
        bad = [t for t in item if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside [0, {vocab})", param="prompt")
        out.append((list(item), sv.tokenizer.decode(item)))
    for tokens, _ in out:
        if not tokens:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        _check_length(sv, len(tokens), "prompt")
    return out


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    t0 = time.perf_counter()
    sv = get_services(request)
    if body.logprobs is not None:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of is not supported (use n)", param="best_of")
    prompts = await _completion_prompts(body, sv)
    seqs, params, echoes = [], [], []
    for tokens, text in prompts:
        for i in range(body.n):
            seqs.append((tokens, None, len(tokens)))
            params.append(sampling(body, sv, i, body.max_tokens))
            echoes.append(text if body.echo else "")
    cid = f"cmpl-{uuid.uuid4().hex}"
    jobs = submit_all(sv.engine, seqs, params, cid)
    meta = st.Meta(id=cid, model=sv.model_id, created=int(time.time()),
                   prompt_tokens=sum(len(t) for t, _ in prompts), echoes=echoes)
    return await _respond(request, sv, body, jobs, meta, t0, st.completion_parts, st.completion_response)


async def _respond(request: Request, sv: Services, body, jobs, meta, t0: float, parts, full) -> Response:
    """The SSE stream (parts: openai_stream.chat_parts / completion_parts) or, once every job is
    done, the whole JSON response (full). A one-choice stream is written by the engine thread
    when the connection allows it (server.api.direct)."""
    recorder = Recorder(sv.metrics, t0)
    if body.stream:
        p = parts(jobs, meta, body.include_usage())
        direct = functools.partial(DirectStream.attach, p, recorder) if sv.settings.direct_stream else None
        return SSEResponse(p.chunks(recorder), metrics=sv.metrics, direct=direct)
    try:
        await collect(request, jobs, recorder)
    except ClientGone:
        return Response(status_code=499)
    return _json(full(jobs, meta))


__all__ = ["router"]
