"""Persistence of tasks and states: the writer's jobs (started rows, claims, progress rows,
settle rows, deletes); task rows and states read back, with the rebuild of a missing state:
server.tasks.statereads (`Persistence.reads`); states written behind and the database byte
budget: server.tasks.statewrites.

A task's token history is its truth, its state a cache of it. A finished task is shown finished
once its row (text, tokens, status; its state pointer still naming the last STORED state) is
committed; its new state then goes to the write-behind lane, which stores it and points the
row at it. A state that is missing when a run starts is rebuilt from the history
(StateReads.resolve_state).

Every database write of a task goes through the one background writer, so writes of one task
land in order; a deleted task's queued writes are skipped. Needs no engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from server.tasks.behind import Pending
from server.tasks.database import DamagedPage
from server.tasks.errors import TaskConflict, TaskElsewhere, TaskNotFound, TaskStale, TaskTagTaken, TaskUnavailable
from server.tasks.records import RUNNING, TEMPLATE, TMP, Task, to_row, update_row
from server.tasks.statereads import StateReads
from server.tasks.statewrites import StateWrites
from server.tasks.store import RowHeld, TagTaken
from server.tasks.writer import UNAVAILABLE_LOG_S

if TYPE_CHECKING:
    from server.model.state import State

log = logging.getLogger("server.tasks")
RETRY_MAX_S = 5.0


class Outcome(NamedTuple):
    """How a run ended: shown on its task once the settle row is committed."""

    reason: str
    error: str | None


@dataclass(slots=True, eq=False)
class SettleJob:
    """A settle write: the task's final row; then its new state goes behind."""

    task: Task
    row: dict[str, Any]
    key: str | None
    """Id of the run's new state (None: no new state)."""
    state: State | None
    pos: int
    """Tokens of the history the new state has consumed."""
    old_key: str | None
    """The state the new one replaces in memory (dropped from the cache when it is the task's
    own). None where there is no new state: the task's state stays current, and cached."""
    outcome: Outcome | None
    """Shown on the task after the commit (None: nothing to show)."""
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    attempts: int = 0
    said: float | None = None  # time.monotonic() of the last line saying it could not be committed


class Persistence:
    def __init__(
        self,
        states: StateWrites,
        *,
        instance: str = "local",
        url_of: Callable[[str | None], str | None] = lambda _: None,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        """`states` writes the final states behind; this object shares its store, writer, cache,
        table and counters, and commits the task rows. `url_of` and `decode` (the tokenizer's, to
        complete the text of a task a crash interrupted) also go to its StateReads."""
        self.states = states
        self.store, self.writer, self.cache, self.table = states.store, states.writer, states.cache, states.table
        self.counters = states.counters
        self.instance = instance
        self.url_of = url_of
        self.lane = self.states.lane
        self.reads = StateReads(states, url_of=url_of, decode=decode)
        self._progress_queued = False  # a progress job is in the writer queue
        self._retries: dict[int, asyncio.TimerHandle] = {}  # id(job) -> its retry timer

    async def start(self) -> None:
        """After the store is open: the budget's starting point; the state lane."""
        await self.states.start()

    async def flush(self) -> None:
        """Until the writer's queue and the pending states are written (or dropped)."""
        await self.writer.flush()
        await self.lane.idle()
        await self.writer.flush()

    async def close(self, timeout: float = 30.0) -> None:
        """Write the pending states (within `timeout`; no more once the writer has found the
        database away during the shutdown: Writer.gone), stop retrying settles."""
        for h in self._retries.values():
            h.cancel()
        self._retries.clear()
        written = await self.writer.unless_gone(self.lane.idle(), timeout) or not len(self.lane)
        await self.states.close(timeout if written else 0)  # (0: what is left is dropped, and said)

    @property
    def db_state_bytes(self) -> int:
        """Stored non-template state bytes, exact for this server's own writes and deletes."""
        return self.states.db_state_bytes

    @property
    def db_state_entries(self) -> int:
        """Stored non-template states, exact for this server's own writes and deletes."""
        return self.states.db_state_entries

    # --- reads (StateReads) ---------------------------------------------------------------------
    async def load_task(self, task_id: str) -> Task | None:
        """StateReads.load_task."""
        return await self.reads.load_task(task_id)

    async def resolve_state(self, t: Task, holder: str | None = None) -> tuple[State | None, int, str | None]:
        """StateReads.resolve_state."""
        return await self.reads.resolve_state(t, holder)

    def release(self, key: str | None) -> None:
        """Unpin a state resolve_state pinned."""
        if key is not None:
            self.cache.unpin(key)

    # --- rows ----------------------------------------------------------------------------------
    async def claim_id(self, t: Task) -> None:
        """Insert the row of the new task t now, shown running here, so that no other server
        of the database takes its id (a template's name) while t is filled; TaskConflict when
        one has. Its later writes update that row."""
        row = {**to_row(t), "status": RUNNING, "instance": self.instance}
        if not await self.writer.call(self.store.insert_new, row, fail_fast=True):
            raise TaskConflict(f"template {t.display_id!r} already exists", param="name")

    async def save_started(self, t: Task, new: bool) -> asyncio.Future[Any]:
        """Queue the row of a run that started; the future is set once it is committed. A new
        task's row is inserted (a burst of starts is one transaction); an existing task is
        claimed: refused (TaskElsewhere, TaskStale, TaskNotFound) when another instance runs it,
        changed it since this server read it, or deleted it."""
        if new:
            return await self.writer.put_many(self._persist_rows, to_row(t), fail_fast=True)
        return await self.writer.put(self._claim, t, update_row(t), fail_fast=True)

    async def _persist_rows(self, rows: list[dict[str, Any]]) -> None:
        try:
            await self.store.save_rows(rows)
        except TagTaken:
            if len(rows) > 1:
                raise  # the writer runs a failed group's rows one by one
            raise TaskTagTaken(f"another task of this owner is tagged {rows[0]['tag']!r}") from None

    async def _claim(self, t: Task, row: dict[str, Any]) -> None:
        miss = await self.store.claim(t.id, t.version, row)
        if miss is None:
            t.version += 1
            return
        if miss.status is None:
            raise TaskNotFound(f"task {t.display_id!r} not found", param="task_id")
        if miss.status != 3 and miss.instance == self.instance:  # (a final row refused for good: _settle_failed)
            raise TaskConflict(
                f"task {t.display_id}'s last run could not be stored (see this server's log); "
                "its stored row still reads running: it is read again (interrupted) after a restart"
            )
        if miss.status != 3:
            raise TaskElsewhere(t.display_id, miss.instance, self.url_of(miss.instance), "continue")
        raise TaskStale(f"task {t.display_id} was changed by another server; read it again")

    def offer_progress(self) -> None:
        """Queue one progress job for all running persistent tasks (unless one is queued: it
        will take the newest text when it runs). Dropped when the writer queue is full."""
        if self._progress_queued:
            return
        self._progress_queued = True
        if not self.writer.offer(self._persist_progress):
            self._progress_queued = False

    async def _persist_progress(self) -> None:
        """The rows of the running persistent tasks with new output since their last progress
        row, in one transaction (one commit per progress interval, however many tasks run).
        A settled task is skipped: its settle write (queued after this job) covers it. So is a
        run whose start row (save_started: an insert, a claim) is not committed, or failed: the
        row is not this instance's, and update_owned would refuse it as taken over; the next
        progress job, or its settle row (written only after that commit), takes its output."""
        self._progress_queued = False
        rows = []
        for t in list(self.table.live.values()):
            run = t.run
            if run is None or t.kind == TMP or t.deleted or not t.running or run.n_out == run.saved_out:
                continue
            started = run.started
            if run.discarded or started is None or not started.done() or started.cancelled() or started.exception():
                continue
            run.saved_out = run.n_out
            rows.append(update_row(t))
        if rows:
            try:
                lost = await self.store.update_owned(rows, self.instance)
            except DamagedPage:  # not retried: the page stays damaged (the store said so, once)
                return
            if lost:
                log.warning("%d running task(s) were taken over by another instance: %s", len(lost), sorted(lost))
            self.counters["progress_writes"] += 1
            self.counters["progress_rows"] += len(rows)

    async def queue_settled(self, job: SettleJob) -> asyncio.Future[None]:
        """Queue a settle row; the future is set once it is committed and the task shown
        finished (a transient failure is retried: until then the task shows as running)."""
        await self.writer.put_many(self._persist_settled, job)
        return job.done

    async def _persist_settled(self, jobs: list[SettleJob]) -> None:
        """Commit settle rows (a burst of tasks finishing together is one transaction), then
        show each finished and queue its new state behind. The writer retries a failed group
        one job at a time; a single job that fails is retried later (transient) or shown
        finished with an error (anything else), and never raises."""
        try:
            lost = await self.store.update_owned([j.row for j in jobs if not j.task.deleted], self.instance)
        except Exception as exc:
            if len(jobs) > 1:
                raise
            self._settle_failed(jobs[0], exc)
            return
        for job in jobs:
            self._settled(job, lost=job.task.id in lost)

    def _settle_failed(self, job: SettleJob, exc: Exception) -> None:
        job.attempts += 1
        t = job.task
        if isinstance(exc, TaskUnavailable):
            self.writer.unavailable(exc)  # (a shutdown gives up on the writes still queued)
            now = time.monotonic()  # said the first time, then at most every UNAVAILABLE_LOG_S
            if job.said is None or now - job.said >= UNAVAILABLE_LOG_S:
                job.said = now
                log.warning("task %s: its final row could not be committed (%s; attempt %d); retrying, the task "
                            "shows as running until then", t.id, exc.message, job.attempts)  # fmt: skip
            self._retries[id(job)] = asyncio.get_running_loop().call_later(
                min(RETRY_MAX_S, 0.05 * 2**job.attempts), self._retry_settle, job
            )
            return
        log.error("task %s: its final row could not be stored: %s", t.id, exc)
        job.outcome = Outcome("error", f"its final row could not be stored: {exc}")
        job.state = None  # not written behind; its key stays, so _settled unpins it
        self._settled(job, lost=False, stored=False)

    def _retry_settle(self, job: SettleJob) -> None:
        self._retries.pop(id(job), None)
        fut = asyncio.ensure_future(self.writer.put_many(self._persist_settled, job))
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _settled(self, job: SettleJob, *, lost: bool, stored: bool = True) -> None:
        """After a settle commit (or a failure that ends it): show the task finished, hand its
        new state to the lane. `lost`: the row was gone or taken over by another instance
        (this instance's lease had expired): the task shows interrupted and is read again. The
        new state of a deleted or lost task is forgotten: neither written nor left in the cache."""
        t, key = job.task, job.key
        t.pending_writes -= 1
        t.instance = None
        if key is not None and (lost or t.deleted or job.state is None):
            if lost or t.deleted:
                # not back to an LRU: no task names it (a lost task is forgotten here and read
                # again from its row; a delete may have forgotten t's states before this run
                # settled: STOPPING_WAIT_S)
                self.cache.discard(key)
            if t.kind != TEMPLATE:
                self.cache.unpin(key)
            key = None
        if job.key is not None and job.old_key and job.old_key != job.key and job.old_key.startswith(t.id + ":"):
            self.cache.discard(job.old_key)
        if lost and not t.deleted:
            t.finish("interrupted", None)
            self.table.forget(t.id)
        elif job.outcome is not None:
            t.finish(*job.outcome)
        if key is not None and job.state is not None:
            self.states.add(Pending(t, key, job.state, job.pos, t.kind == TEMPLATE, job.state.nbytes()))
        if stored:
            self.table.retire(t)
        if not job.done.done():
            job.done.set_result(None)

    async def delete(self, t: Task) -> None:
        """Delete t's row (and its state when no other task names it); waits for the commit."""
        self.lane.discard(t.id)
        await self.writer.call(self._delete_job, t, fail_fast=True)

    async def _delete_job(self, t: Task) -> None:
        try:
            _, dropped = await self.store.delete_task(t.id, self.instance)
        except RowHeld as held:  # a replica runs it (this copy was stale): delete it there
            raise TaskElsewhere(t.display_id, held.instance, self.url_of(held.instance), "delete") from None
        self.states.dropped(dropped)
