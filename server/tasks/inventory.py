"""Inventory: listing, statistics and the TMP_ janitor (drops finished TMP tasks after their TTL)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from server.tasks.cache import StateCache
from server.tasks.listing import Listing, ascii_lower
from server.tasks.records import REBUILD, STORED, TEMPLATE, TMP, Task, display_id
from server.tasks.schema import DbRow
from server.tasks.store import Store
from server.tasks.table import TaskTable
from server.tasks.templates import being_made

if TYPE_CHECKING:
    from server.model.state import State

PREVIEW_CHARS = 80
"""Characters of a task's prompt in its listed summary (`prompt_preview`)."""


class Inventory:
    def __init__(
        self,
        table: TaskTable,
        store: Store,
        cache: StateCache[State],
        counters: Counter[str],
        *,
        tmp_task_ttl: float,
        db_state_bytes: Callable[[], int],
        db_state_entries: Callable[[], int],
        writer_backlog: Callable[[], int],
        lane: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.table, self.cache, self.counters = table, cache, counters
        self.listing = Listing(store)  # the stored rows' page (the store's reads)
        self.tmp_task_ttl = float(tmp_task_ttl)
        self._db_state_bytes = db_state_bytes  # Persistence.db_state_bytes, read when asked
        self._db_state_entries = db_state_entries  # Persistence.db_state_entries (no query)
        self._writer_backlog = writer_backlog  # jobs in the writer's queue
        self._lane = lane  # the write-behind lane's stats (bytes, entries, dropped)
        self._janitor: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._janitor = asyncio.create_task(self._sweep_loop(), name="task-janitor")

    def close(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()

    async def list(
        self,
        owner_id: str | None,
        *,
        all_owners: bool,
        limit: int = 100,
        offset: int = 0,
        kind: str | None = None,
        prompt_contains: str | None = None,
    ) -> dict[str, Any]:
        """A page of the tasks `owner_id` may list (all_owners: every task), newest first: the
        TMP tasks in memory and the stored tasks; its own and the public templates, less those
        a private template of its own shadows, and less the templates whose as_template has
        not answered yet (being_made). `prompt_contains`: only the tasks whose last prompt's
        text contains it, ASCII letters of either case alike (Listing.list_tasks). Each summary
        has its `prompt_preview`."""
        needle = None if prompt_contains is None else ascii_lower(prompt_contains)

        def visible(t: Task) -> bool:
            mine = all_owners or t.owner == owner_id or (t.kind == TEMPLATE and t.public)
            found = needle is None or needle in ascii_lower(t.prompt)
            return mine and found and (kind is None or t.kind == kind) and not t.deleted and not being_made(t)

        mem: Sequence[Task] = [t for t in self.table.held() if visible(t)]
        if not all_owners and owner_id is not None:
            mem = await self._unshadowed(owner_id, mem)
        mem_only = [t for t in mem if t.kind == TMP]
        rows: list[DbRow] = []
        db_total = 0
        if kind != TMP:
            rows, db_total = await self.listing.list_tasks(
                owner_id, all_owners, kind, offset + limit, 0, prompt_contains, head=PREVIEW_CHARS + 1
            )
        items = {t.id: _summary(t, self.cache) for t in mem_only}
        for r in rows:
            if r.id not in items:
                items[r.id] = seen_by(owner_id, all_owners, r.owner, _row_summary(r, self.table.find(r.id), self.cache))
        order = sorted(items, key=lambda i: (-items[i]["created_at"], items[i]["task_id"]))[offset : offset + limit]
        stored = {r.id for r in rows}
        return {
            "cpu_cache_count": len(mem),
            "database_count": db_total,
            "total_count": db_total + len(mem_only),
            "cpu_tasks": [t.display_id for t in mem],
            "db_tasks": [display_id(i) for i in order if i in stored],  # the stored tasks of this page
            "tasks": [items[i] for i in order],
            "limit": limit,
            "offset": offset,
        }

    async def _unshadowed(self, owner_id: str, held: Sequence[Task]) -> Sequence[Task]:
        """`held` less the public templates a private template of owner_id's of the same name
        shadows (the name reaches that one: Access.lookup); the database says, as it does for
        the stored rows listed (listing.listable)."""
        public = [t.id for t in held if t.kind == TEMPLATE and t.public]
        hidden = await self.listing.shadowed(owner_id, public) if public else set()
        return [t for t in held if t.id not in hidden]

    async def _sweep_loop(self) -> None:
        ttl = self.tmp_task_ttl
        interval = max(0.05, min(ttl / 4, 10.0))
        while True:
            await asyncio.sleep(interval)
            self.sweep(time.time() - ttl)

    def sweep(self, cutoff: float) -> int:
        """Drop TMP tasks that finished before `cutoff` (epoch seconds)."""
        old = [
            t
            for t in self.table.live.values()
            if t.kind == TMP and not t.running and t.finished_at is not None and t.finished_at < cutoff
        ]
        for t in old:
            self.table.live.pop(t.id, None)
            t.deleted = True
            if t.state_id and t.state_id.startswith(t.id + ":"):
                self.cache.discard(t.state_id)
        return len(old)

    def stats(self) -> dict[str, Any]:
        """Cache tiers and counters. tiers.database.bytes / entries: the stored non-template
        states' bytes and number (this server's writes and deletes count at once; another
        replica's at the next budget check; both are kept in memory, never queried here).
        tiers.tmp: the states of finished TMP_ tasks (Settings.tmp_state_bytes);
        tiers.write_behind: finished tasks' states waiting to be written (pinned meanwhile, so
        also in tasks_pinned). counters.rebuilds / rebuild_tokens: runs that re-fed history a
        missing state had consumed, and those tokens."""
        c = self.cache.stats()
        running = sum(1 for t in self.table.live.values() if t.running)
        lane = self._lane()
        return {
            "tiers": {
                # hits by the tier that held the state; a miss (in no tier: loaded or rebuilt)
                # and a load joined in flight count under tasks_lru
                "tasks_lru": {
                    "bytes": c["lru_bytes"],
                    "entries": c["lru_count"],
                    "hits": c["lru_hits"] + c["loading_hits"],
                    "misses": c["misses"],
                },
                "tasks_pinned": {"bytes": c["pinned_bytes"], "entries": c["pinned_count"], "hits": c["pinned_hits"]},
                "templates": {
                    "bytes": c["template_bytes"],
                    "entries": c["template_count"],
                    "hits": c["templates_hits"],
                },
                "tmp": {"bytes": c["tmp_bytes"], "entries": c["tmp_count"], "hits": c["tmp_hits"]},
                "write_behind": {"bytes": lane.get("bytes", 0), "entries": lane.get("entries", 0)},
                "database": {
                    "bytes": self._db_state_bytes(),
                    "entries": self._db_state_entries(),
                    "hits": self.counters["db_state_loads"],
                    "misses": self.counters["state_misses"],
                },
            },
            "tasks_live": len(self.table.live),
            "tasks_running": running,
            "writer_queue": self._writer_backlog(),
            "counters": dict(self.counters),
        }


def seen_by(viewer: str | None, all_owners: bool, owner: str | None, summary: dict[str, Any]) -> dict[str, Any]:
    """A task's summary as `viewer` sees it: another key's (public) template does not name the
    task it was made from (that key's own, which the viewer cannot read)."""
    if not all_owners and owner != viewer:
        summary["parent_id"] = None
    return summary


def preview(prompt: str | bytes | None) -> str:
    """A prompt's first PREVIEW_CHARS characters, and "…" when it is longer. bytes: the start of
    one in UTF-8, maybe cut inside its last character (Listing.list_tasks on SQLite, where the
    start of "" is NULL)."""
    if not prompt:
        return ""
    if isinstance(prompt, bytes):
        prompt = prompt.decode("utf-8", "ignore")
    return prompt if len(prompt) <= PREVIEW_CHARS else prompt[:PREVIEW_CHARS] + "…"


def _summary(t: Task, held: StateCache[State]) -> dict[str, Any]:
    return {**t.summary(held), "prompt_preview": preview(t.prompt)}


def _row_summary(r: DbRow, t: Task | None, held: StateCache[State]) -> dict[str, Any]:
    if t is not None:
        return _summary(t, held)
    return {
        "task_id": display_id(r.id),
        "kind": r.kind,
        "status": r.status,
        "finish_reason": r.finish_reason,
        "generated_buf": r.completion_tokens,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
        "parent_id": display_id(r.parent_id),
        "state": STORED if r.state_id else REBUILD,
        "instance": r.instance,
        "public": bool(r.public),
        "prompt_preview": preview(r.prompt_head),
    }
