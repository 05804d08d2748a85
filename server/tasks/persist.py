"""Persistence of tasks and states: state loading, the writer's jobs (started rows, progress rows,
settle commits, deletes) and the database byte budget.

Every database write of a task goes through the one background writer, so writes of one task land
in order; a deleted task's queued writes are skipped. Needs no engine: the store, the writer, the
state cache, the task table and the counters are all it works with.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from server.tasks.cache import StateCache
from server.tasks.codec import EncodedState, StateCodecError, decode_state, encode_state
from server.tasks.errors import TaskConflict
from server.tasks.records import TEMPLATE, TMP, Task, from_row, to_row
from server.tasks.store import Store, state_row
from server.tasks.table import TaskTable
from server.tasks.writer import Writer

if TYPE_CHECKING:
    from server.model.state import State

log = logging.getLogger("server.tasks")


class Outcome(NamedTuple):
    """How a run ended: shown on its task once the settle write is committed."""

    reason: str
    error: str | None


@dataclass(slots=True)
class SettleJob:
    """A settle write: the task's final row with its new state, its old state dropped."""

    task: Task
    row: dict[str, Any]
    key: str | None
    """Id of the new state to store (None: no new state)."""
    state: State | None
    old_key: str | None
    """The state it replaces (dropped from the database once no task names it)."""
    outcome: Outcome | None
    """Shown on the task after the commit (None: nothing to show, e.g. a template's state)."""

    @property
    def weight(self) -> int:
        """The bytes it writes (the writer's group budget)."""
        return self.state.nbytes() if self.key is not None and self.state is not None else 0


class Persistence:
    def __init__(self, store: Store, writer: Writer, cache: StateCache[State], table: TaskTable,
                 counters: Counter[str], *, signature: str, db_budget_bytes: int) -> None:
        self.store, self.writer, self.cache, self.table = store, writer, cache, table
        self.counters = counters
        self.signature = signature
        self.db_budget_bytes = db_budget_bytes
        self.db_state_bytes = 0
        """Stored non-template state bytes: exact at start and after each budget check, an
        upper bound in between (see _account_state)."""
        self._progress_queued = False  # a progress job is in the writer queue

    async def start(self) -> None:
        """After the store is open: the budget's starting point."""
        self.db_state_bytes = await self.store.states_bytes(templates=False)

    # --- reads ---------------------------------------------------------------------------------
    async def load_task(self, task_id: str) -> Task | None:
        """The stored task (kept as recently read), or the copy loaded meanwhile."""
        row = await self.store.get_task(task_id)
        if row is None:
            return self.table.find(task_id)
        return self.table.remember(from_row(row))

    async def resolve_state(self, t: Task) -> tuple[State | None, int, str | None]:
        """(state, state_pos, pinned key) to start t's next run from; (None, 0, None) when the
        state is gone (budget, restart of a TMP parent): the run then recomputes from zero."""
        sid = t.state_id
        if not sid:
            return None, 0, None
        st = await self.cache.get_or_load(sid, partial(self._load_state, sid))
        if st is None or t.state_id != sid:
            self.counters["state_misses"] += 1
            if t.state_id == sid:  # gone (budget, or a TMP parent's state): recompute from zero
                t.state_id, t.state_pos = None, 0
            return None, 0, None
        self.cache.pin(sid, st)
        return st, t.state_pos, sid

    def release(self, key: str | None) -> None:
        """Unpin a state resolve_state pinned."""
        if key is not None:
            self.cache.unpin(key)

    async def _load_state(self, sid: str) -> State | None:
        row = await self.store.get_state(sid)
        if row is None:
            return None
        try:
            st = await asyncio.to_thread(decode_state, orjson.loads(row.meta), row.data,
                                         self.signature, row.checksum)
        except StateCodecError as exc:
            raise TaskConflict(str(exc)) from exc
        self.counters["db_state_loads"] += 1
        self.writer.offer(self.store.touch_states, [sid])  # budget eviction is least recently used
        if row.is_template and sid not in self.cache:
            self.cache.put(sid, st, template=True)
        return st

    # --- writer jobs ---------------------------------------------------------------------------
    async def save_started(self, t: Task) -> asyncio.Future[None]:
        """Queue the row of a task that started; the future is set once it is committed (the
        writer merges a burst of starts into one transaction)."""
        return await self.writer.put_many(self._persist_rows, to_row(t))

    async def _persist_rows(self, rows: list[dict[str, Any]]) -> None:
        await self.store.save_rows(rows)

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
        A settled task is skipped: its settle write (queued after this job) covers it."""
        self._progress_queued = False
        rows = []
        for t in list(self.table.live.values()):
            run = t.run
            if run is None or t.kind == TMP or t.deleted or not t.running or run.n_out == run.saved_out:
                continue
            run.saved_out = run.n_out
            rows.append(to_row(t))
        if rows:
            await self.store.save_progress(rows)
            self.counters["progress_writes"] += 1
            self.counters["progress_rows"] += len(rows)

    async def queue_settled(self, job: SettleJob) -> asyncio.Future[None]:
        """Queue a settle write; it weighs its state's bytes in the writer's group."""
        return await self.writer.put_many(self._persist_settled, job, weight=job.weight)

    async def _persist_settled(self, jobs: list[SettleJob]) -> None:
        """Commit settled tasks: each row with its new state, the old state dropped, all in ONE
        transaction (a burst of tasks finishing together is one commit, up to the writer's
        GROUP_BYTES); then show each finished. The states are encoded in turn, the next while
        the current one is written, and their bytes are dropped once written. The writer may
        call this with a group and, if that raises, once per job: so after a failed group
        nothing is undone or shown (the single calls do it); a single call cleans up even when
        it fails."""
        stored: list[tuple[int, bool]] = []  # (nbytes, is_template) of each state written
        ok = False
        try:
            await self.store.save_each(self._settle_rows(jobs, stored))
            ok = True
            for nbytes, _ in stored:
                self.counters["state_writes"] += 1
                self.counters["state_write_bytes"] += nbytes
            try:  # committed: a failing budget check must not make the writer retry the jobs
                for nbytes, is_template in stored:
                    await self._account_state(nbytes, is_template)
            except Exception:
                log.exception("database budget check failed")
        finally:
            if ok or len(jobs) == 1:
                for job in jobs:
                    self._settled(job)

    async def _settle_rows(self, jobs: list[SettleJob], stored: list[tuple[int, bool]]
                           ) -> AsyncIterator[tuple[dict[str, Any], dict[str, Any] | None, list[str]]]:
        """(task row, state row, states to drop) of each job for Store.save_each. The next
        job's state is encoded while this one is written: at most two states' bytes in memory
        (2 x 21 MB at 2.9B fp32)."""
        nxt = self._encode(jobs, 0)
        try:
            for i, job in enumerate(jobs):
                cur, nxt = nxt, self._encode(jobs, i + 1)
                t = job.task
                if t.deleted:
                    _discard(cur)
                    continue
                srow = None
                if cur is not None and job.key is not None:
                    srow = state_row(job.key, t.id, await cur, t.kind == TEMPLATE)
                    stored.append((srow["nbytes"], srow["is_template"]))
                old = job.old_key
                yield job.row, srow, [old] if old and old != job.key else []
        finally:
            _discard(nxt)  # the write failed or stopped early: drop the prefetch

    def _encode(self, jobs: list[SettleJob], i: int) -> asyncio.Future[EncodedState] | None:
        """Job i's state encoding, started in a thread (None: no state, or no job i)."""
        if i >= len(jobs):
            return None
        job = jobs[i]
        if job.key is None or job.state is None or job.task.deleted:
            return None
        return asyncio.ensure_future(asyncio.to_thread(encode_state, job.state, self.signature))

    def _settled(self, job: SettleJob) -> None:
        """After a settle commit (or its failure): release the states, show the task finished."""
        t, key, old_key = job.task, job.key, job.old_key
        if key is not None and t.kind != TEMPLATE:
            self.cache.unpin(key)
        if key is not None and old_key and old_key != key and old_key.startswith(t.id + ":"):
            self.cache.discard(old_key)
        t.pending_writes -= 1
        if job.outcome is not None:
            t.finish(*job.outcome)
        self.table.retire(t)

    async def delete(self, t: Task) -> None:
        """Delete t's row (and its state when no other task names it); waits for the commit."""
        await self.writer.call(self._delete_job, t)

    async def _delete_job(self, t: Task) -> None:
        await self.store.delete_task(t.id)

    # --- the database budget -------------------------------------------------------------------
    async def _account_state(self, nbytes: int, is_template: bool) -> None:
        """After a state was stored: the database budget is checked (a query over all states)
        only when it may be exceeded. db_state_bytes stays an upper bound of the stored
        non-template bytes: it grows by every stored state and is set to the true total by each
        check, while dropped and deleted states only lower the true total."""
        grown = 0 if is_template else int(nbytes)
        if self.db_state_bytes + grown <= self.db_budget_bytes:
            self.db_state_bytes += grown
            return
        await self._enforce_db_budget()

    async def _enforce_db_budget(self) -> None:
        """Drop the least recently used stored states beyond the budget, those held only by the
        LRU cache last (cache hits do not touch the database's last_used). A state in use (a
        running task's, pinned) is kept. A dropped state leaves memory too, and the tasks that
        named it say state_id None, as the database now does: no task keeps an id that is gone."""
        keep = self.cache.pinned_keys() | {x.state_id for x in self.table.running() if x.state_id}
        victims, total = await self.store.enforce_budget(self.db_budget_bytes, keep,
                                                         prefer=self.cache.keys())
        self.db_state_bytes = total
        if victims:
            gone = set(victims)
            for sid in gone:
                self.cache.discard(sid)
            for x in self.table.held():
                if x.state_id in gone and not x.running:  # a running one settles a new state
                    x.state_id, x.state_pos = None, 0
            self.counters["db_evictions"] += len(victims)
            log.info("database budget: dropped %d states (%.1f MiB of states left)",
                     len(victims), total / 2**20)


def _discard(fut: asyncio.Future[Any] | None) -> None:
    """Cancel an encoding nobody will use (its exception, if any, retrieved: no asyncio warning)."""
    if fut is not None:
        fut.cancel()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
