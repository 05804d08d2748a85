"""Lightning's batch requests on the shared engine: every prompt is one engine sequence (all
submitted together, or none), so prompts of separate requests share the engine's batches as
those of one request do. Answered as native JSON once all are done, or as SSE.

A request's prompts all wait in the engine's queue until slots free up, so a batch larger than
the queue (Settings.max_queue) can never be taken: 400, lightning's "bsz overflow".
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from server.api.errors import ApiError, prompt_too_long
from server.api.generation.jobs import Job, Prompt, collect, submit_all
from server.api.generation.stream import ChoiceStream
from server.api.latency import Recorder
from server.api.lightning.auth import authorize
from server.api.lightning.errors import LightningError, bsz_overflow
from server.api.lightning.render import FlushingRenderer, native_renderer, native_response
from server.api.lightning.schemas import LightningV1Body, limits
from server.api.services import Services, get_services, json_response
from server.api.streaming.sse import SSEResponse
from server.engine.protocol import StateLike
from server.engine.types import SamplingParams

ENCODE_INLINE_CHARS = 16_384


def new_id(kind: str) -> str:
    """An engine request id base for one lightning request (each prompt adds `-<index>`)."""
    return f"lightning-{kind}-{uuid.uuid4().hex}"


async def encode_all(sv: Services, texts: list[str]) -> list[list[int]]:
    """Token ids of each text; long batches in a worker thread so the event loop keeps serving."""
    if sum(map(len, texts)) < ENCODE_INLINE_CHARS:
        return [sv.tokenizer.encode(t) for t in texts]
    return await asyncio.to_thread(lambda: [sv.tokenizer.encode(t) for t in texts])


def check_batch(sv: Services, n: int, field: str) -> None:
    if n == 0:
        raise LightningError(400, f"'{field}' must hold at least one prompt")
    bound = sv.settings.max_queue
    if bound and n > bound:
        raise bsz_overflow(n, bound)


def check_prompt(sv: Services, tokens: list[int], field: str) -> None:
    if not tokens:
        raise LightningError(400, f"'{field}' is an empty prompt")
    limit = sv.settings.max_prompt_tokens
    if len(tokens) > limit:
        raise prompt_too_long(field, len(tokens), limit)


async def submit(
    sv: Services, prompts: list[str], params: SamplingParams, field: str, init_state: StateLike | None = None
) -> list[Job]:
    """One engine sequence per prompt (raw text, never rewritten), in order; 400 / 413 / 429
    before anything runs when the batch or a prompt cannot be taken."""
    check_batch(sv, len(prompts), field)
    ids = await encode_all(sv, prompts)
    for i, tokens in enumerate(ids):
        check_prompt(sv, tokens, f"{field}[{i}]")
    seqs: list[Prompt] = [(tokens, init_state, len(tokens)) for tokens in ids]
    return submit_all(sv.engine, seqs, [params] * len(seqs), new_id(field), max_queue=sv.settings.max_queue)


def sse(sv: Services, jobs: list[Job], t0: float, renderer: FlushingRenderer) -> SSEResponse:
    """The jobs' stream: the renderer's bytes (server.api.generation.stream.ChoiceStream); when
    it ends early (the server shuts down), the text the renderer holds goes out before the error."""
    source = ChoiceStream(jobs, renderer, Recorder(sv.metrics, t0))
    return SSEResponse(source, metrics=sv.metrics, direct=sv.settings.direct_stream, error_end=renderer.error_end)


async def respond(
    request: Request,
    sv: Services,
    jobs: list[Job],
    t0: float,
    *,
    stream: FlushingRenderer | None,
    full: Callable[[list[Job]], dict[str, Any]],
) -> Response:
    """The SSE stream of `stream`'s bytes, or (None) the JSON `full(jobs)` once every job is
    done; a client that leaves first aborts the jobs (499)."""
    if stream is not None:
        return sse(sv, jobs, t0, stream)
    await collect(request, jobs, Recorder(sv.metrics, t0))  # (ClientGone: answered 499, counted as an abort)
    failed = next((j for j in jobs if j.finish_reason == "error"), None)
    if failed is not None:
        raise ApiError(500, f"generation failed: {failed.error or 'unknown error'}", code="generation_failed")
    return json_response(full(jobs))


async def contents(body: LightningV1Body, request: Request, *, answer_id: str) -> Response:
    """POST /v1/chat/completions with `contents` (answer_id "rwkv7-batch") and
    /v2/chat/completions ("rwkv7-batch-v2"): one choice per prompt, in order."""
    t0 = time.perf_counter()
    authorize(request, body.password)
    sv = get_services(request)
    jobs = await submit(sv, body.contents, body.sampling(*limits(sv)), "contents")
    renderer = native_renderer(jobs, body.chunk_size) if body.stream else None
    return await respond(
        request,
        sv,
        jobs,
        t0,
        stream=renderer,
        full=lambda js: native_response(js, id=answer_id, object="chat.completion", model=body.model),
    )
