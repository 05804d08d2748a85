"""Persistence of tasks and states (a mixin of TaskManager): state loading, writer jobs, the
database byte budget. Every database write of a task goes through the one background writer, so
writes of one task land in order; a deleted task's queued writes are skipped."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from server.tasks.codec import StateCodecError, decode_state, encode_state
from server.tasks.errors import TaskConflict
from server.tasks.records import TEMPLATE, TMP, Task, to_row
from server.tasks.store import state_row

log = logging.getLogger("server.tasks")


class PersistMixin:
    # provided by TaskManager: store, cache, writer, live, recent, settings, signature, counters

    def _row(self, t: Task) -> dict[str, Any]:
        return to_row(t)

    async def _resolve_state(self, t: Task) -> tuple[Any, int, str | None]:
        """(state, state_pos, pinned key) to start t's next run from; (None, 0, None) when the
        state is gone (budget, restart of a TMP parent): the run then recomputes from zero."""
        sid = t.state_id
        if not sid:
            return None, 0, None
        st = self.cache.get(sid)
        if st is None:
            st = await self._load_state(sid)
        if st is None or t.state_id != sid:
            self.counters["state_misses"] += 1
            if t.state_id == sid:  # gone (budget, or a TMP parent's state): recompute from zero
                t.state_id, t.state_pos = None, 0
            return None, 0, None
        self.cache.pin(sid, st)
        return st, t.state_pos, sid

    async def _load_state(self, sid: str) -> Any:
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
        if sid not in self.cache:  # another request may have loaded it meanwhile
            self.cache.put(sid, st, template=bool(row.is_template))
        return self.cache.get(sid) or st

    # --- writer jobs ---------------------------------------------------------------------------
    async def _persist_rows(self, rows: list[dict[str, Any]]) -> None:
        """Rows of started tasks, one transaction (the writer merges a burst of starts)."""
        await self.store.save_rows(rows)

    def _offer_progress(self) -> None:
        """Queue one progress job for all running persistent tasks (unless one is queued: it
        will take the newest text when it runs). Dropped when the writer queue is full."""
        if self._progress_queued:
            return
        self._progress_queued = True
        if not self.writer.offer(self._persist_progress):
            self._progress_queued = False

    async def _persist_progress(self) -> None:
        """The rows of the running persistent tasks with new output since their last progress
        row, in one transaction (one commit per PROGRESS_INTERVAL, however many tasks run).
        A settled task is skipped: its settle write (queued after this job) covers it."""
        self._progress_queued = False
        rows = []
        for t in list(self.live.values()):
            run = t.run
            if run is None or t.kind == TMP or t.deleted or not t.running or run.n_out == run.saved_out:
                continue
            run.saved_out = run.n_out
            rows.append(self._row(t))
        if rows:
            await self.store.save_progress(rows)
            self.counters["progress_writes"] += 1
            self.counters["progress_rows"] += len(rows)

    async def _queue_settled(self, item: tuple) -> asyncio.Future:
        """Queue a settle write, item (t, row, key, state, old_key, outcome) for _persist_settled;
        it weighs its state's bytes in the writer's group (none without a new state)."""
        key, state = item[2], item[3]
        return await self.writer.put_many(self._persist_settled, item,
                                          weight=state.nbytes() if key is not None else 0)

    async def _persist_settled(self, items: list[tuple]) -> None:
        """Commit settled tasks, items (t, row, key, state, old_key, outcome): each row with its
        new state, the old state dropped, all in ONE transaction (a burst of tasks finishing
        together is one commit, up to the writer's GROUP_BYTES); then show each finished. The
        states are encoded in turn, the next while the current one is written, and their bytes
        are dropped once written. The writer (put_many) may call this with a group and, if that
        raises, once per item: so after a failed group nothing is undone or shown (the single
        calls do it); a single call cleans up even when it fails."""
        stored: list[tuple[int, bool]] = []  # (nbytes, is_template) of each state written
        ok = False

        def encode(i: int) -> asyncio.Future | None:
            """Item i's state encoding, started in a thread (None: no state, or no item i)."""
            if i >= len(items) or items[i][2] is None or items[i][0].deleted:
                return None
            return asyncio.ensure_future(asyncio.to_thread(encode_state, items[i][3], self.signature))

        async def writes():
            # the next item's state is encoded while this one is written: at most two states'
            # bytes in memory (2 x 21 MB at 2.9B fp32)
            nxt = encode(0)
            try:
                for i, (t, row, key, state, old_key, _) in enumerate(items):
                    cur, nxt = nxt, encode(i + 1)
                    if t.deleted:
                        _discard(cur)
                        continue
                    srow = None
                    if cur is not None:
                        srow = state_row(key, t.id, await cur, t.kind == TEMPLATE)
                        stored.append((srow["nbytes"], srow["is_template"]))
                    yield row, srow, [old_key] if old_key and old_key != key else []
            finally:
                _discard(nxt)  # the write failed or stopped early: drop the prefetch

        try:
            await self.store.save_each(writes())
            ok = True
            for nbytes, _ in stored:
                self.counters["state_writes"] += 1
                self.counters["state_write_bytes"] += nbytes
            try:  # committed: a failing budget check must not make the writer retry the items
                for nbytes, is_template in stored:
                    await self._account_state(nbytes, is_template)
            except Exception:  # noqa: BLE001 - logged; the next stored state checks again
                log.exception("database budget check failed")
        finally:
            if ok or len(items) == 1:
                for it in items:
                    self._settled(*it)

    def _settled(self, t: Task, row: dict[str, Any], key: str | None, state: Any, old_key: str | None,
                 outcome: tuple[str, str | None] | None) -> None:
        """After a settle commit (or its failure): release the states, show the task finished."""
        if key is not None and t.kind != TEMPLATE:
            self.cache.unpin(key)
        if key is not None and old_key and old_key != key and old_key.startswith(t.id + ":"):
            self.cache.discard(old_key)
        t.pending_writes -= 1
        if outcome is not None:
            self._finalize(t, *outcome)
        self._retire(t)

    def _retire(self, t: Task) -> None:
        """A finished persistent task whose writes are done leaves the live set."""
        if not t.running and t.pending_writes <= 0 and self.live.get(t.id) is t and t.kind != "tmp":
            self.live.pop(t.id, None)
            if not t.deleted:
                self.recent[t.id] = t

    async def _account_state(self, nbytes: int, is_template: bool) -> None:
        """After a state was stored: the database budget is checked (a query over all states)
        only when it may be exceeded. db_state_bytes stays an upper bound of the stored
        non-template bytes: it grows by every stored state and is set to the true total by each
        check, while dropped and deleted states only lower the true total."""
        grown = 0 if is_template else int(nbytes)
        if self.db_state_bytes + grown <= self.settings.db_budget_bytes:
            self.db_state_bytes += grown
            return
        await self._enforce_db_budget()

    async def _enforce_db_budget(self) -> None:
        """Drop the least recently used stored states beyond the budget, those held only by the
        LRU cache last (cache hits do not touch the database's last_used). A state in use (a
        running task's, pinned) is kept. A dropped state leaves memory too, and the tasks that
        named it say state_id None, as the database now does: no task keeps an id that is gone."""
        keep = self.cache.pinned_keys() | {x.state_id for x in self.live.values() if x.running and x.state_id}
        victims, total = await self.store.enforce_budget(self.settings.db_budget_bytes, keep,
                                                         prefer=self.cache.keys())
        self.db_state_bytes = total
        if victims:
            gone = set(victims)
            for sid in gone:
                self.cache.discard(sid)
            for x in list(self.live.values()) + list(self.recent.values()):
                if x.state_id in gone and not x.running:  # a running one settles a new state
                    x.state_id, x.state_pos = None, 0
            self.counters["db_evictions"] += len(victims)
            log.info("database budget: dropped %d states (%.1f MiB of states left)",
                     len(victims), total / 2**20)

    async def _delete_job(self, t: Task) -> None:
        await self.store.delete_task(t.id)


def _discard(fut: asyncio.Future | None) -> None:
    """Cancel an encoding nobody will use (its exception, if any, retrieved: no asyncio warning)."""
    if fut is not None:
        fut.cancel()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
