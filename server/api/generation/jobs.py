"""The engine sequences of a request (one per OpenAI choice or lightning prompt): submitting
them, their events merged in arrival order with per-request metrics, and waiting for a whole
answer (a client that leaves aborts them). Shared by the OpenAI routes (chat and completions)
and lightning's batch routes, streaming or not."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from server.api.errors import ApiError, engine_error
from server.api.latency import Recorder
from server.api.streaming.watch import done_or_gone, draining_event, wait_disconnect
from server.engine.protocol import EngineAPI, Handle, StateLike
from server.engine.types import Event, QueueFullError, SamplingParams, TokenLogprob

log = logging.getLogger("server.generation")


T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected while we waited for a non-streaming answer (or a prefill)."""


@dataclass
class Job:
    """One engine sequence of a request (an OpenAI choice, a lightning prompt)."""

    index: int
    handle: Handle
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    t_last: float | None = None  # when its last tokens arrived (kept by the Recorder)
    logprobs: list[TokenLogprob] | None = None
    """With SamplingParams.logprobs: one per generated token so far."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """With SamplingParams.prompt_logprobs: the prompt's (from the first event)."""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


Prompt = tuple[Sequence[int], StateLike | None, int]
"""(tokens to submit, the state they start from or None, prompt tokens to report)."""


def submit_all(
    engine: EngineAPI,
    prompts: list[Prompt],
    params: list[SamplingParams],
    base_id: str,
    *,
    return_state: bool | Sequence[bool] = False,
    max_queue: int = 0,
) -> list[Job]:
    """One sequence per (prompt, params): all submitted, or none (the engine's error raised as
    an ApiError). return_state (one for all, or one per sequence): their Results carry the final
    states (the conversation cache); their streams end without waiting for them. max_queue (the
    engine's Settings.max_queue; 0: no bound): a request the queue cannot take whole is a 429
    before any sequence is submitted (see check_room)."""
    check_room(engine, len(prompts), max_queue)
    keeps = [return_state] * len(prompts) if isinstance(return_state, bool) else list(return_state)
    jobs: list[Job] = []
    try:
        for i, ((tokens, init_state, n_prompt), p, keep) in enumerate(zip(prompts, params, keeps, strict=True)):
            h = engine.submit(
                tokens,
                p,
                init_state=init_state,
                request_id=f"{base_id}-{i}",
                return_state=keep,
                end_before_state=keep,
            )
            jobs.append(Job(index=i, handle=h, prompt_tokens=n_prompt))
    except Exception as exc:
        abort_all(jobs)
        raise engine_error(exc) from exc
    return jobs


def check_room(engine: EngineAPI, n: int, max_queue: int) -> None:
    """A 429 (as the engine's QueueFullError) when n sequences would not all fit in the waiting
    queue now. Checked before submitting, because a sequence aborted after a partial submission
    still counts as waiting until the engine's next step, so a refused request would refuse the
    requests after it too. The engine takes the free slots, then at most max_queue waiting
    sequences per engine (one engine per device behind a router: stats() sums the slots, running
    and waiting of the live ones). One sequence
    needs no check (the engine's own refusal leaves nothing behind). Submissions from the event
    loop cannot interleave with this check; one from another thread still can (then the engine
    refuses, as before: a partial submission, aborted)."""
    if not max_queue or n <= 1:
        return
    st = engine.stats()
    room = max_queue * st.engines_alive + max(0, st.slots - st.running) - st.waiting
    if n > room:
        msg = f"{st.waiting} requests are waiting and this one needs {n} more (max_queue={max_queue})"
        raise engine_error(QueueFullError(msg))


def abort_all(jobs: list[Job]) -> None:
    for j in jobs:
        if not j.done:
            try:
                j.handle.abort()
            except Exception:
                log.exception("abort failed")


def events(jobs: list[Job], recorder: Recorder) -> AsyncGenerator[tuple[Job, list[Event]], None]:
    """Batches of events of all jobs, merged, in arrival order: (job, that job's events taken
    at one wake-up, in order; a finished event is the last of its job). Closing the iterator
    aborts unfinished jobs."""
    if len(jobs) == 1:  # the common case: no helper task and no queue hop per batch
        return _events_one(jobs[0], recorder)
    return _events_many(jobs, recorder)


def _error_batch(job: Job) -> list[Event]:
    return [Event(text="", token_ids=[], n_tokens=job.completion_tokens, finished=True, finish_reason="error")]


def failed_batch(job: Job, exc: BaseException) -> list[Event]:
    """The batch that ends a job the engine failed (its handle raised exc)."""
    job.error = str(exc) or type(exc).__name__
    return _error_batch(job)


async def _events_many(jobs: list[Job], recorder: Recorder) -> AsyncGenerator[tuple[Job, list[Event]], None]:
    queue: asyncio.Queue[tuple[Job, list[Event] | None]] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for batch in job.handle.batches():
                queue.put_nowait((job, batch))
                if batch[-1].finished:
                    break
        except Exception as exc:
            job.error = str(exc) or type(exc).__name__
            queue.put_nowait((job, _error_batch(job)))
        finally:
            queue.put_nowait((job, None))

    pumps = [asyncio.create_task(pump(j)) for j in jobs]
    live = len(jobs)
    try:
        while live:
            job, batch = await queue.get()
            if batch is None:
                live -= 1
                continue
            record(job, batch, recorder)
            if job.finish_reason == "error" and job.error is None:
                job.error = await _error_of(job)
            yield job, batch
    finally:
        abort_all(jobs)
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        recorder.finish()


async def _events_one(job: Job, recorder: Recorder) -> AsyncGenerator[tuple[Job, list[Event]], None]:
    """events() for one job: the handle's batches straight from it."""
    handle = job.handle
    try:
        failed = None
        try:
            while True:
                batch = await handle.next_batch()
                if not batch:
                    return
                record(job, batch, recorder)
                if job.finish_reason == "error" and job.error is None:
                    job.error = await _error_of(job)
                yield job, batch
                if job.finish_reason is not None:
                    return
        except Exception as exc:
            failed = exc
        if failed is not None:
            batch = failed_batch(job, failed)
            record(job, batch, recorder)
            yield job, batch
    finally:
        abort_all([job])
        recorder.finish()


def record(job: Job, batch: list[Event], recorder: Recorder) -> None:
    """Account a batch of the job's events (text, token count, finish, metrics)."""
    recorder.on_batch(job, batch)
    last = batch[-1]
    if len(batch) == 1:
        job.text.append(last.text)
    else:
        job.text.extend(ev.text for ev in batch)
    job.completion_tokens = last.n_tokens
    first = batch[0]
    if first.logprobs is not None or first.prompt_logprobs is not None:
        _record_logprobs(job, batch)
    if last.finished:
        job.finish_reason = last.finish_reason or "stop"


def _record_logprobs(job: Job, batch: list[Event]) -> None:
    for ev in batch:
        if ev.prompt_logprobs is not None:
            job.prompt_logprobs = ev.prompt_logprobs
        if ev.logprobs is not None:
            if job.logprobs is None:
                job.logprobs = []
            job.logprobs.extend(ev.logprobs)


async def _error_of(job: Job) -> str:
    try:
        res = await asyncio.wait_for(job.handle.wait(), 5)
        return res.error or "generation failed"
    except Exception as exc:
        return str(exc) or "generation failed"


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s value, the client watched meanwhile (done_or_gone): a client that leaves first
    cancels it (a conversation prefill no other request waits for is aborted with it) and
    raises ClientGone; ApiError 503 `shutting_down` when the server begins to drain."""
    fut = asyncio.ensure_future(work)
    if not await done_or_gone(request, fut):
        log.info("client left while its prompt was prefilled; aborting the prefill")
        raise ClientGone()
    return fut.result()


async def collect(request: Request, jobs: list[Job], recorder: Recorder) -> list[Job]:
    """Run all jobs to the end (non-streaming). A client that leaves aborts them (ClientGone)."""

    async def drain() -> None:
        async for _ in events(jobs, recorder):
            pass

    work = asyncio.create_task(drain())
    watcher = asyncio.create_task(wait_disconnect(request.receive))
    draining = draining_event(request.app)
    stop = asyncio.create_task(draining.wait()) if draining is not None else None
    try:
        done, _ = await asyncio.wait(
            {t for t in (work, watcher, stop) if t is not None}, return_when=asyncio.FIRST_COMPLETED
        )
        if work in done:
            work.result()
            return jobs
        if watcher in done:
            log.info("client left before the answer; aborting %d sequence(s)", len(jobs))
            raise ClientGone()
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    finally:
        for t in (work, watcher, stop):
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in (work, watcher, stop) if t is not None), return_exceptions=True)
        abort_all(jobs)
