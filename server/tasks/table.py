"""The tasks held in memory: the live set and the recently read finished tasks.

`live` holds every task whose truth is in memory: TMP tasks (never stored), running tasks and
stored tasks whose settle write is still queued. `recent` is an LRU of finished stored tasks read
lately (their truth is the database; they are kept so polling them costs no query). A task is in
at most one of the two. Runs, persistence, the inventory and the manager share one table.

A delete is fenced against reads that overlap it: a row read from the database while its delete
is in flight, or read before a delete that has finished since, is stale and must not be kept
(it would bring the deleted task back into `recent`). `read_ticket()` before the query and
`stale(id, ticket)` after it tell.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from cachetools import LRUCache

from server.tasks.errors import TaskConflict
from server.tasks.records import FINISHED, PREFILL, TMP, Task

RECENT_TASKS = 1024


class TaskTable:
    def __init__(self, recent: int = RECENT_TASKS) -> None:
        self.live: dict[str, Task] = {}
        self.recent: LRUCache[str, Task] = LRUCache(maxsize=recent)
        self.deleting: set[str] = set()
        self._deletes = 0  # deletes finished so far: the read tickets' clock
        self._deleted_at: LRUCache[str, int] = LRUCache(maxsize=recent)  # id -> its delete's tick

    def find(self, task_id: str) -> Task | None:
        return self.live.get(task_id) or self.recent.get(task_id)

    def remember(self, t: Task) -> Task:
        """Keep t (read from the database) as recently read, unless a copy of it is held
        already (loaded meanwhile): that copy is returned then."""
        cur = self.find(t.id)
        if cur is not None:
            return cur
        self.recent[t.id] = t
        return t

    def claim(self, t: Task) -> Task:
        """Mark t (or the live copy of it) as starting, synchronously, so two requests cannot
        both start it. Raises TaskConflict when it is running."""
        cur = self.live.get(t.id)
        if cur is not None and cur is not t:
            t = cur
        if t.running:
            raise TaskConflict(f"task {t.id} is running; stop it or wait until it finishes")
        t.status = PREFILL  # running from now on; READY only once its run waits behind a full engine (Runs)
        t.done = asyncio.Event()
        self.recent.pop(t.id, None)
        self.live[t.id] = t
        return t

    def unclaim(self, t: Task, new: bool) -> None:
        """Undo claim() after a start failed (a new task is forgotten)."""
        if new:
            self.live.pop(t.id, None)
        else:
            t.status = FINISHED
            self.retire(t)  # a stored one is the database's again: reads check its row
        if t.done is not None:
            t.done.set()

    def retire(self, t: Task) -> None:
        """A finished stored task whose writes are done leaves the live set for `recent`."""
        if not t.running and t.pending_writes <= 0 and self.live.get(t.id) is t and t.kind != TMP:
            self.live.pop(t.id, None)
            if not t.deleted:
                self.recent[t.id] = t

    def forget(self, task_id: str) -> None:
        self.live.pop(task_id, None)
        self.recent.pop(task_id, None)

    def begin_delete(self, task_id: str) -> None:
        self.deleting.add(task_id)
        self.forget(task_id)

    def end_delete(self, task_id: str, committed: bool = True) -> None:
        """The delete committed (rows read before it are stale), or failed (they are not)."""
        if committed:
            self._deletes += 1
            self._deleted_at[task_id] = self._deletes
            self.forget(task_id)
        self.deleting.discard(task_id)

    def restore(self, t: Task) -> None:
        """Hold t again after a delete that failed: live while it runs or has writes queued,
        else as recently read."""
        self.live[t.id] = t
        self.retire(t)

    def read_ticket(self) -> int:
        return self._deletes

    def stale(self, task_id: str, ticket: int) -> bool:
        """A row of task_id read with `ticket` may predate a delete of it."""
        return task_id in self.deleting or self._deleted_at.get(task_id, -1) > ticket

    def running(self) -> Iterator[Task]:
        return (t for t in list(self.live.values()) if t.running)

    def held(self) -> list[Task]:
        """Every task in memory (live first)."""
        return list(self.live.values()) + list(self.recent.values())


class Snapshot:
    """What starting a run changes on a task (Runs.start), to undo it when the start fails."""

    FIELDS = (
        "status",
        "out_start",
        "prompt_len",
        "out",
        "gen_time",
        "prefill_time",
        "finish_reason",
        "stop_requested",
        "interrupted",
        "run",
        "prompt_tokens",
        "completion_tokens",
        "updated_at",
        "instance",
    )

    def __init__(self, t: Task, fields: dict[str, Any]) -> None:
        self.n_tokens, self.fields = len(t.tokens), fields
        out = t.out
        last = out.offsets[-1] if out.offsets else 0
        self.out = (out.finished, out.finish_reason, out.error, out.text, len(out.offsets), last)

    @classmethod
    def of(cls, t: Task, update: dict[str, Any]) -> Snapshot:
        return cls(t, {k: getattr(t, k) for k in (*cls.FIELDS, *update)})

    def restore(self, t: Task) -> None:
        del t.tokens[self.n_tokens :]
        for k, v in self.fields.items():
            setattr(t, k, v)
        out = t.out  # the output as it was: text a run appended to it goes, text it took back returns
        out.finished, out.finish_reason, out.error, out.text, n_tokens, last = self.out
        del out.offsets[n_tokens:]
        if n_tokens:
            out.offsets[-1] = last
