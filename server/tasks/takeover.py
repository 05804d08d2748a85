"""What this instance does when tasks change hands among replicas (a `Takeover`, called back by
the heartbeat of server.tasks.lease through `Lease.run`).

- Another instance died (`reaped`): the others marked the tasks it was running interrupted in the
  database, so the copies of them held here are out of date. Those not live here are forgotten
  (read again from their rows when next asked for).
- This instance's own lease had expired (`lost`): the others marked the tasks it was running then
  interrupted, and may run them now. Those runs are stopped here as "interrupted" (their final
  writes are refused anyway: `Store.update_owned`); a task started since, whose row still names
  this instance, runs on. One read of the database tells which is which (`held_by`); where it
  fails, every running stored task is stopped, as is safe.

Kept out of the task manager (server.tasks.manager), a facade over the API's operations; the
heartbeat itself, the instance row and its database writes stay in lease.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from server.tasks.records import TMP, Task
from server.tasks.table import TaskTable

__all__ = ["HeldRows", "Takeover"]

log = logging.getLogger("server.tasks")


class HeldRows(Protocol):
    """What a takeover needs of the store (server.tasks.store.Store)."""

    async def held_by(self, ids: list[str], instance: str) -> set[str]: ...


class Takeover:
    """The task manager's reactions to the lease: stale copies of a dead instance's tasks
    forgotten, and the runs taken from this instance stopped. `abort` aborts a task's run
    (Runs.abort)."""

    def __init__(self, table: TaskTable, store: HeldRows, instance: str, abort: Callable[[Task], None]) -> None:
        self.table, self.store, self.instance, self.abort = table, store, instance, abort
        self.background: set[asyncio.Task[None]] = set()
        """The stops under way (`lost`): held so that they are not collected before they end."""

    def reaped(self, ids: list[str]) -> None:
        """Another instance died: the copies of its tasks held here are out of date."""
        for task_id in ids:
            if task_id not in self.table.live:
                self.table.forget(task_id)

    def lost(self) -> None:
        """This instance's lease had expired: the others marked the tasks it was running then
        interrupted (and may run them now). Stop those here (their final writes are refused
        anyway); a task started since, whose row is still this instance's, runs on."""
        running = [t for t in self.table.running() if t.kind != TMP]  # (TMP tasks have no row)
        if running:
            task = asyncio.create_task(self._stop_taken(running), name="lease-lost")
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    async def _stop_taken(self, running: list[Task]) -> None:
        """Stop those of `running` whose rows this instance no longer holds, as "interrupted"."""
        try:
            held = await self.store.held_by([t.id for t in running], self.instance)
        except Exception as exc:  # the database is away: stop them all, as is safe
            log.warning("after the lease expired, could not read which tasks are still ours (%s)", exc)
            held = set()
        for t in running:
            if t.id not in held and t.running:  # (one that settled meanwhile is left alone)
                t.interrupted = True
                self.abort(t)
