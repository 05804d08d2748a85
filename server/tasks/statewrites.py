"""States written behind their tasks' rows, and the database's byte budget for states.

`StateWrites` owns the write-behind lane (server.tasks.behind): it encodes a pending state in one
thread of lowered CPU priority (on a busy host the engine and the event loop go first), commits
it through the writer (the row then names it), and keeps `db_state_bytes` and
`db_state_entries`, the stored non-template states' bytes and number, exact for this server's own
writes and deletes (another replica's are seen at each budget check).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from server.tasks.behind import Pending, StateLane
from server.tasks.cache import StateCache
from server.tasks.codec import encode_state
from server.tasks.database import DamagedPage, damaged
from server.tasks.statestore import state_row
from server.tasks.store import Store
from server.tasks.table import TaskTable
from server.tasks.writer import Writer

if TYPE_CHECKING:
    from server.model.state import State

log = logging.getLogger("server.tasks")


class StateWrites:
    def __init__(
        self,
        store: Store,
        writer: Writer,
        cache: StateCache[State],
        table: TaskTable,
        counters: Counter[str],
        *,
        signature: str,
        db_budget_bytes: int,
        write_behind_bytes: int,
        store_dtype: str | None,
    ) -> None:
        self.store, self.writer, self.cache, self.table = store, writer, cache, table
        self.counters = counters
        self.signature = signature
        self.db_budget_bytes = db_budget_bytes
        self.store_dtype = store_dtype
        self.lane = StateLane(self._encode_state, self._write_state, self._drop_pending, max_bytes=write_behind_bytes)
        self.db_state_bytes = 0
        """Stored non-template state bytes."""
        self.db_state_entries = 0
        """Stored non-template states (/metrics' `rwkv_state_cache_entries{tier="database"}`).
        Kept in memory, beside db_state_bytes and by the same rule, rather than counted when
        /metrics asks: every state this server writes or drops passes through this object (or
        Persistence, which tells it), so the figure costs nothing to read, and /metrics (through
        the synchronous TaskManager.stats) never touches the database. A COUNT per scrape would
        make the scrape wait on the database (a PostgreSQL away: up to its timeouts), or, cached
        to avoid that, show the previous scrape's figure. Read from the database at start and
        after each budget check, as db_state_bytes is (other replicas' states count from then)."""
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="task-state-encode", initializer=_background)

    async def start(self) -> None:
        self.db_state_bytes = await self.store.states.states_bytes(templates=False)
        self.db_state_entries = await self.store.states.states_count(templates=False)
        if self.db_state_bytes > self.db_budget_bytes:  # a restart with a lower budget: not at the next write
            await self._enforce_db_budget()
        self.lane.start()

    async def close(self, timeout: float) -> None:
        """Write the pending states within `timeout` seconds (the rest is dropped)."""
        await self.lane.drain(timeout)
        self._encoder.shutdown(wait=False)

    def add(self, p: Pending) -> None:
        """Queue a finished task's new state (pinned in the cache until written or dropped)."""
        self.lane.add(p)

    async def _encode_state(self, p: Pending) -> dict[str, Any] | None:
        """The lane's prepare: p's states row, encoded in the encoder thread (None: deleted)."""
        if p.task.deleted:
            return None
        enc = await asyncio.get_running_loop().run_in_executor(
            self._encoder, partial(encode_state, p.state, self.signature, wkv_dtype=self.store_dtype)
        )
        return state_row(p.key, p.task.id, enc, p.template)

    async def _write_state(self, p: Pending, srow: dict[str, Any] | None) -> None:
        """The lane's write: one transaction through the writer."""
        if srow is None or p.task.deleted:
            self._release(p)
            return
        await self.writer.call(self._store_state, p, srow)

    async def _store_state(self, p: Pending, srow: dict[str, Any]) -> None:
        t = p.task
        try:
            if t.deleted:
                return
            try:
                stored, dropped = await self.store.states.store_state(t.id, srow, p.pos)
            except DamagedPage:  # not retried: the page stays damaged (the store said so, once)
                self.counters["state_writes_dropped"] += 1
                log.debug("state write of %s dropped: the task database is damaged", t.id)
                return
            self.dropped(dropped)
            if not stored:
                return
            if p.pos >= t.stored_pos or t.stored_id is None:
                t.stored_id, t.stored_pos = p.key, p.pos
            self.counters["state_writes"] += 1
            self.counters["state_write_bytes"] += srow["nbytes"]
            try:  # committed: a failing budget check must not count as a failed write
                await self._account_state(srow["nbytes"], p.template)
            except Exception as exc:
                if not damaged(exc):  # (a damaged page: the store said so, once)
                    log.exception("database budget check failed")
        finally:
            self._release(p)

    def dropped(self, nbytes: int) -> None:
        """A store call dropped `nbytes` of non-template state (what store_state, drop_state and
        delete_task return): that is one state, as each drops at most one; every state has
        bytes, so 0 means none was dropped (or a template's, which is not counted)."""
        if nbytes:
            self.db_state_bytes -= nbytes
            self.db_state_entries -= 1

    def _drop_pending(self, p: Pending, why: str) -> None:
        """A pending state that will not be written: it stays in the cache while the cache
        keeps it (then its task is rebuilt from its tokens)."""
        if why != "superseded":
            self.counters["state_writes_dropped"] += 1
        self._release(p)

    def _release(self, p: Pending) -> None:
        if not p.template:
            self.cache.unpin(p.key)
        if p.task.deleted:
            self.cache.discard(p.key)

    # --- the database budget -------------------------------------------------------------------
    async def _account_state(self, nbytes: int, is_template: bool) -> None:
        """After a state was stored: the database budget is checked (a query over all states)
        only when it may be exceeded (another replica's states are seen then)."""
        grown = 0 if is_template else int(nbytes)
        if self.db_state_bytes + grown <= self.db_budget_bytes:
            self.db_state_bytes += grown
            self.db_state_entries += 0 if is_template else 1
            return
        await self._enforce_db_budget()

    async def _enforce_db_budget(self) -> None:
        """Drop the least recently used stored states beyond the budget, those held only by the
        LRU cache last (cache hits do not touch the database's last_used). A state in use (a
        running task's, pinned) is kept. A dropped state leaves memory too, and the tasks that
        named it say so, as the database now does: no task keeps an id that is gone."""
        keep = self.cache.pinned_keys() | {x.state_id for x in self.table.running() if x.state_id}
        victims, total = await self.store.states.enforce_budget(self.db_budget_bytes, keep, prefer=self.cache.keys())
        self.db_state_bytes = total
        # one more read where the budget check already read every state's size (on the writer,
        # so no write of this server's comes between): the count, other replicas' states included
        self.db_state_entries = await self.store.states.states_count(templates=False)
        if victims:
            gone = set(victims)
            for sid in gone:
                self.cache.discard(sid)
            for x in self.table.held():
                if x.stored_id in gone:
                    x.stored_id, x.stored_pos = None, 0
                if x.state_id in gone and not x.running:  # a running one settles a new state
                    x.state_id, x.state_pos = x.stored_id, x.stored_pos
            self.counters["db_evictions"] += len(victims)
            log.info("database budget: dropped %d states (%.1f MiB of states left)", len(victims), total / 2**20)


def _background() -> None:
    """Lower the calling thread's CPU priority (Linux: threads have their own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not allowed: keep the normal priority
        pass
