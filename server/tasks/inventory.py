"""Listing, statistics and the TMP_ janitor (a mixin of TaskManager)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from server.tasks.records import TMP, Task


class InventoryMixin:
    # provided by TaskManager: live, recent, store, cache, writer, counters, settings, owner_id

    async def list(self, owner: str | None = None, *, limit: int = 100, offset: int = 0,
                   kind: str | None = None) -> dict[str, Any]:
        oid = self.owner_id(owner)

        def visible(t: Task) -> bool:
            return (owner is None or t.owner == oid) and (kind is None or t.kind == kind) and not t.deleted

        mem = [t for t in list(self.live.values()) + list(self.recent.values()) if visible(t)]
        mem_only = [t for t in mem if t.kind == TMP]
        rows, db_total = ([], 0) if kind == TMP else await self.store.list_tasks(
            oid, owner is None, kind, offset + limit, 0)
        items = {t.id: t.summary() for t in mem_only}
        for r in rows:
            items.setdefault(r.id, _row_summary(r, self.live.get(r.id) or self.recent.get(r.id)))
        page = sorted(items.values(), key=lambda d: (-d["created_at"], d["task_id"]))[offset:offset + limit]
        return {"cpu_cache_count": len(mem), "database_count": db_total,
                "total_count": db_total + len(mem_only), "cpu_tasks": [t.id for t in mem],
                "db_tasks": [r.id for r in rows][offset:offset + limit], "tasks": page,
                "limit": limit, "offset": offset}

    async def _sweep_loop(self) -> None:
        ttl = float(self.settings.tmp_task_ttl)
        interval = max(0.05, min(ttl / 4, 10.0))
        while True:
            await asyncio.sleep(interval)
            self.sweep(time.time() - ttl)

    def sweep(self, cutoff: float) -> int:
        """Drop TMP tasks that finished before `cutoff` (epoch seconds)."""
        old = [t for t in self.live.values() if t.kind == TMP and not t.running
               and t.finished_at is not None and t.finished_at < cutoff]
        for t in old:
            self.live.pop(t.id, None)
            t.deleted = True
            if t.state_id and t.state_id.startswith(t.id + ":"):
                self.cache.discard(t.state_id)
        return len(old)

    def stats(self) -> dict[str, Any]:
        """Cache tiers and counters. tiers.database.bytes: the stored non-template state bytes,
        exact at start-up and at each budget check, an upper bound in between (stored states
        add to it; replaced and deleted states are only subtracted by the next check)."""
        c = self.cache.stats()
        running = sum(1 for t in self.live.values() if t.running)
        return {
            "tiers": {
                "tasks_lru": {"bytes": c["lru_bytes"], "entries": c["lru_count"],
                              "hits": c["hits"], "misses": c["misses"]},
                "tasks_pinned": {"bytes": c["pinned_bytes"], "entries": c["pinned_count"]},
                "templates": {"bytes": c["template_bytes"], "entries": c["template_count"]},
                "database": {"bytes": self.db_state_bytes, "hits": self.counters["db_state_loads"],
                             "misses": self.counters["state_misses"]},
            },
            "tasks_live": len(self.live), "tasks_running": running,
            "writer_queue": self.writer.queue.qsize(), "counters": dict(self.counters),
        }


def _row_summary(r: Any, t: Task | None) -> dict[str, Any]:
    if t is not None:
        return t.summary()
    return {"task_id": r.id, "kind": r.kind, "status": r.status, "finish_reason": r.finish_reason,
            "generated_buf": r.completion_tokens, "created_at": r.created_at,
            "updated_at": r.updated_at, "parent_id": r.parent_id}
