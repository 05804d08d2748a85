"""The SSE stream of a request's engine jobs as a StreamSource (server.api.streaming.source):
the renderer's bytes for the jobs' events, on the event loop (`rest`) or taken by the engine
thread right after a delivery (`take`, one-choice streams only: server.api.streaming.direct).
The renderers are the protocols': server.api.openai.render and agent_render, and
server.api.lightning.render."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from server.api.errors import error_body
from server.api.generation.jobs import Job, abort_all, events, failed_batch, record
from server.api.latency import Recorder
from server.api.streaming.source import DONE, event
from server.engine.types import Event


@dataclass
class Renderer:
    """A stream's bytes, by piece: the chunks before any event (one per job, or none),
    render(job, batch) -> (bytes, whether the job's finish chunk is in them), end() -> the usage
    chunk (when asked for) + [DONE]."""

    preamble: list[bytes]
    render: Callable[[Job, list[Event]], tuple[bytes, bool]]
    end: Callable[[], bytes]


def error_event(job: Job) -> bytes:
    """The event that ends a stream whose job the engine failed."""
    return event(
        error_body(f"generation failed: {job.error or 'unknown error'}", "server_error", None, "generation_failed")
    )


class ChoiceStream:
    foreign_thread = True  # a handle's listener runs on the engine thread

    def __init__(self, jobs: list[Job], renderer: Renderer, recorder: Recorder) -> None:
        self.jobs, self.renderer, self.recorder = jobs, renderer, recorder
        self.stops_work = True  # its jobs are the request's own
        self.path: str | None = "direct" if len(jobs) == 1 else None  # n > 1: merged on the loop
        self._ended = False

    @property
    def preamble(self) -> list[bytes]:
        return self.renderer.preamble

    @property
    def ended(self) -> bool:
        return self._ended

    def take(self) -> tuple[bytes, bool] | None:
        """What next_batch + events() + _take do, without waiting (one-choice streams)."""
        job = self.jobs[0]
        try:
            batch = job.handle.take_ready()
        except Exception as exc:
            batch = failed_batch(job, exc)
        if batch is None:
            return None
        if not batch:  # ended without a finishing event
            self._ended = True
            return self.renderer.end(), True
        record(job, batch, self.recorder)
        if job.finish_reason == "error" and job.error is None:
            res = job.handle.peek_result()  # delivered with the finishing event
            job.error = (res.error if res is not None else None) or "generation failed"
        return self._take(job, batch)

    async def rest(self) -> AsyncGenerator[bytes, None]:
        """The chunks after the preamble (and after what take() returned), one write per batch
        (all of a job's events of one wake-up), until the stream's end."""
        async with aclosing(events(self.jobs, self.recorder)) as batches:
            async for job, batch in batches:  # closed with this generator (a client gone: events() cleans up)
                out, last = self._take(job, batch)
                if out:
                    yield out
                if last:
                    return
        self._ended = True
        yield self.renderer.end()

    def _take(self, job: Job, batch: list[Event]) -> tuple[bytes, bool]:
        """The bytes of one batch of a job's events (already recorded), and whether the stream
        ends with them: an error ends it at once; the last job's finish chunk and the end of the
        stream go out in the same write."""
        if job.finish_reason == "error":
            self._ended = True
            return error_event(job) + DONE, True
        out, finished = self.renderer.render(job, batch)
        if finished and all(j.done for j in self.jobs):
            self._ended = True
            return out + self.renderer.end(), True
        return out, False

    def listen(self, fn: Callable[[], None] | None) -> None:
        self.jobs[0].handle.set_listener(fn)

    def abort(self) -> None:
        abort_all(self.jobs)

    def close(self) -> None:
        """Abort unfinished sequences, record the duration (once, whichever path ended it)."""
        abort_all(self.jobs)
        self.recorder.finish()
