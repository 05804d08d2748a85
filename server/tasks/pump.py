"""The pump of a run (server.tasks.runs): its engine events into the task's output, then its
settle (server.tasks.settle).

The per-batch work (`Pump.on_batch`) runs on the event loop once per engine step per task: it
appends, counts and wakes the stream readers, nothing more. While a persistent task runs, its
progress is offered to the persistence at most once per PROGRESS_INTERVAL seconds, one write for
all running tasks (the throttle is the Pump's: Runs has one).

A persistent run settles only once its start row is committed; if the commit failed, the pump
undoes the start (`Run.undo`: the sequence aborted, the task as it was) and settles nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from server.engine.types import Event, Result
from server.tasks.records import PREFILL, READY, RUNNING, TMP, Run, Task
from server.tasks.token_logprobs import LogprobBudget

__all__ = ["PROGRESS_INTERVAL", "Pump", "PumpPersistence", "RunSettler"]

log = logging.getLogger("server.tasks")
PROGRESS_INTERVAL = 1.0  # seconds between the progress writes of the running persistent tasks


class PumpPersistence(Protocol):
    """What a pump needs of the persistence (server.tasks.persist.Persistence)."""

    def offer_progress(self) -> None: ...


class RunSettler(Protocol):
    """What a pump needs to settle a finished run (server.tasks.settle.Settler)."""

    async def settle(self, t: Task, run: Run, res: Result | None, error: str | None) -> None: ...


class Pump:
    """Follows runs' events into their tasks' outputs and settles each run at its end. `abort`
    aborts a task's run (Runs.abort): a cancelled pump ends its run as "interrupted". `logprobs`:
    the bound on the logprobs ended outputs hold (server.tasks.token_logprobs)."""

    def __init__(
        self,
        persistence: PumpPersistence,
        settler: RunSettler,
        abort: Callable[[Task], None],
        logprobs: LogprobBudget | None = None,
    ) -> None:
        self.persistence, self.settler, self.abort = persistence, settler, abort
        self.logprobs = logprobs or LogprobBudget()
        self._progress_at = 0.0  # monotonic time of the last progress job offered

    async def follow(self, t: Task, run: Run) -> None:
        """Take run's events until it ends, then settle it (a persistent run: after its start
        row's commit; not at all where that failed and the start was undone)."""
        res: Result | None = None
        error: str | None = None
        try:
            if run.handle is not None:
                async for batch in run.handle.batches():  # all the events of a wake-up at once
                    self.on_batch(t, run, batch)
                res = await run.handle.wait()
        except asyncio.CancelledError:
            self.abort(t)
            error = "interrupted"
        except Exception as exc:
            log.warning("task %s failed: %s", t.id, exc)
            error = f"{type(exc).__name__}: {exc}"
        if run.recorder is not None:
            run.recorder.finish()
        if run.started is not None:  # a persistent run: its start row first
            try:
                await asyncio.shield(run.started)
            except asyncio.CancelledError:
                if not run.started.cancelled():
                    raise  # the pump itself was cancelled
                if run.undo is not None:
                    run.undo()
            except Exception:
                if run.undo is not None:
                    run.undo()
        if not run.discarded:
            await self.settler.settle(t, run, res, error)
        if t.out.logprobs is not None:
            self.logprobs.ended(t.out)

    def on_batch(self, t: Task, run: Run, batch: list[Event]) -> None:
        if run.discarded:
            return
        for ev in batch:
            self._on_event(t, run, ev)
        if run.recorder is not None:
            run.recorder.on_batch(run, batch)
        t.completion_tokens = len(t.out)
        t.out.notify()  # the stream readers wake once per batch
        if t.kind != TMP and not batch[-1].finished:
            now = time.monotonic()
            if now - self._progress_at >= PROGRESS_INTERVAL:  # one write for all running tasks
                self._progress_at = now
                self.persistence.offer_progress()

    def _on_event(self, t: Task, run: Run, ev: Event) -> None:
        n = len(ev.token_ids)
        if n and run.t_first is None:
            run.t_first = time.monotonic()
            if not len(t.out):  # the output's first token: its prefill_time, fixed from now on
                t.prefill_time = run.t_first - run.t_submit
        if n or ev.text:
            t.tokens.extend(ev.token_ids)
            t.out.append(ev.text, n, ev.logprobs)
            run.n_out += n
        if n and not ev.finished and t.status in (PREFILL, READY):
            t.status = RUNNING
