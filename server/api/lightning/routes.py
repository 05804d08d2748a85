"""rwkv_lightning's routes (docs/lightning.md): batch completion (V2; V1 shares POST
/v1/chat/completions with the OpenAI chat, whose route is v1_chat's), translate, FIM, big
batch, its OpenAI-style chat and models, and the state sessions (state_routes)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.generation.jobs import submit_all
from server.api.lightning import batch, chat_prompt, docs, state_routes
from server.api.lightning.auth import CredentialFirst, authorize
from server.api.lightning.errors import LightningError
from server.api.lightning.render import chat_style_renderer, chat_style_response, native_renderer, native_response
from server.api.lightning.schemas import (
    BigBatchBody,
    ChatStyleBody,
    FimBody,
    LightningV2Body,
    TranslateBody,
    limits,
    sampling_params,
)
from server.api.openai import start as openai_start
from server.api.openai.render import Meta
from server.api.services import get_services, json_response
from server.tasks.params import fim_prompt

router = APIRouter(tags=["rwkv_lightning"], route_class=CredentialFirst)  # the key before the body
router.include_router(state_routes.router)

LANGUAGES = {
    "zh-CN": "Chinese",
    "zh-TW": "Chinese",
    "en": "English",
    "ja": "Japanese",
    "fr": "French",
    "de": "German",
    "es": "Spanish",
    "ru": "Russian",
}
"""The language codes lightning names in its translation prompts, exactly (any other code is
written as given, `ko` as `ko`): the same request makes the same prompt, so the same answer."""


@router.post("/v2/chat/completions", responses=docs.BATCH)
async def v2_chat_completions(body: LightningV2Body, request: Request) -> Response:
    return await batch.contents(body, request, answer_id="rwkv7-batch-v2")


@router.post("/big_batch/completions", responses=docs.responses(400, 401, 413, 429, 503, ok=("sse",)))
async def big_batch(body: BigBatchBody, request: Request) -> Response:
    """Always streamed; every prompt a sequence of the shared engine (as many at once as it holds)."""
    t0 = time.perf_counter()
    authorize(request, body.password)
    sv = get_services(request)
    jobs = await batch.submit(sv, body.contents, body.sampling(*limits(sv)), "contents")
    return batch.sse(sv, jobs, t0, native_renderer(jobs, body.chunk_size))


@router.post("/FIM/v1/batch-FIM", responses=docs.BATCH)
async def batch_fim(body: FimBody, request: Request) -> Response:
    """prefix[i] and suffix[i] make prompt i (RWKV-7 FIM format); stop_tokens does not apply."""
    t0 = time.perf_counter()
    authorize(request, body.password)
    if len(body.prefix) != len(body.suffix):
        raise LightningError(
            400,
            f"prefix and suffix are paired by position: got {len(body.prefix)} prefixes "
            f"and {len(body.suffix)} suffixes",
        )
    sv = get_services(request)
    prompts = [fim_prompt(p, s) for p, s in zip(body.prefix, body.suffix, strict=True)]
    jobs = await batch.submit(sv, prompts, body.sampling(*limits(sv), stop=[]), "prefix")
    return await batch.respond(
        request,
        sv,
        jobs,
        t0,
        stream=native_renderer(jobs, body.chunk_size) if body.stream else None,
        full=lambda js: native_response(js, id="rwkv7-batch", object="FIM.completion", model=body.model),
    )


@router.post("/translate/v1/batch-translate", responses=docs.responses(400, 401, 413, 429, 503, ok=("json",)))
async def batch_translate(body: TranslateBody, request: Request) -> Response:
    """The Immersive Translate custom API: `{Source}: {text}\\n\\n{Target}:`, greedy, no
    penalties, no stop strings, up to 2048 tokens (ours: `max_tokens`); each translation stripped."""
    t0 = time.perf_counter()
    authorize(request, body.password)
    sv = get_services(request)
    if not body.text_list:  # nothing to translate: lightning answers an empty list too
        return json_response({"translations": []})
    src, tgt = (LANGUAGES.get(c, c) for c in (body.source_lang, body.target_lang))
    prompts = [f"{src}: {text}\n\n{tgt}:" for text in body.text_list]
    params = sampling_params(
        {
            "max_tokens": body.max_tokens,
            "temperature": 0.0,
            "presence_penalty": 0.0,
            "repetition_penalty": 0.0,
            "stop": [],
        },
        *limits(sv),
    )
    jobs = await batch.submit(sv, prompts, params, "text_list")
    detected = body.source_lang if body.source_lang != "auto" else "en"
    return await batch.respond(
        request,
        sv,
        jobs,
        t0,
        stream=None,
        full=lambda js: {
            "translations": [{"detected_source_lang": detected, "text": "".join(j.text).strip()} for j in js]
        },
    )


# --- its OpenAI-style routes -----------------------------------------------------------------------
@router.get("/openai/v1/models", responses=docs.responses(401, 503, ok=("json",)))
async def chat_style_models(request: Request) -> Response:
    """Lightning's model list: our model's id on lightning's card (`owned_by` is always
    "rwkv_lightning" there; our GET /v1/models keeps our own card)."""
    card = {"id": get_services(request).model_id, "object": "model", "owned_by": "rwkv_lightning"}
    return json_response({"object": "list", "data": [card]})


@router.post("/openai/v1/chat/completions", responses=docs.BATCH)
async def chat_style_completions(body: ChatStyleBody, request: Request) -> Response:
    """One choice; lightning's prompt format (chat_prompt) and defaults; `use_prefix_cache` takes
    the system block's state from the chat-prefix cache."""
    t0 = time.perf_counter()
    owner = authorize(request, body.password)
    sv = get_services(request)
    params = body.sampling(*limits(sv))
    prefix, rest = chat_prompt.build(body)
    prefix_ids, rest_ids = await batch.encode_all(sv, [prefix, rest])
    n_prompt = len(prefix_ids) + len(rest_ids)
    batch.check_prompt(sv, prefix_ids + rest_ids, chat_prompt.main_field(body))
    # the chat-prefix cache's state after the system block (the OpenAI route's helper); its tokens
    # count as cached where the state was kept before this request, as on the OpenAI route
    state, cached = None, 0
    if body.use_prefix_cache and prefix_ids:  # (no system block: nothing to keep)
        hit = sv.prefix_cache.key(prefix, openai_start.prefix_part(sv, owner)) in sv.prefix_cache.cache
        state = await openai_start.prefix_state(sv, prefix, prefix_ids, owner)
        cached = len(prefix_ids) if hit else 0
    tokens = rest_ids if state is not None else prefix_ids + rest_ids
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    jobs = submit_all(sv.engine, [(tokens, state, n_prompt)], [params], cid)
    meta = Meta(id=cid, model=sv.model_id, created=int(time.time()), prompt_tokens=n_prompt, cached_tokens=cached)
    stream = chat_style_renderer(meta, body.chunk_size or 1) if body.stream else None
    return await batch.respond(request, sv, jobs, t0, stream=stream, full=lambda js: chat_style_response(js[0], meta))
