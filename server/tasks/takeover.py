"""What this instance does when tasks change hands among replicas (a `Takeover`, called back by
the heartbeat of server.tasks.lease through `Lease.run`).

- Another instance died (`reaped`): the others marked the tasks it was running interrupted in the
  database, so the copies of them held here are out of date. Those not live here are forgotten
  (read again from their rows when next asked for).
- This instance's own lease had expired (`lost`): the others marked the tasks it was running then
  interrupted, and may run them now. Those runs are stopped here as "interrupted" (their final
  writes are refused anyway: `Store.update_owned`); a task started since, whose row still names
  this instance, runs on. One read of the database tells which is which (`held_by`), made for
  each run once its start row is committed: a run acknowledged just as the lease was found lost
  (a burst of creates that woke a stalled process with its heartbeat) may still have its row in
  the writer's queue, and a row not there yet is no row taken over. A run whose start row was not
  even queued when the loss was found is this instance's (its row is written after the instance
  registered again). Where the read fails (retried a few times), every running stored task
  whose row could not be told is stopped, as is safe.

Kept out of the task manager (server.tasks.manager), a facade over the API's operations; the
heartbeat itself, the instance row and its database writes stay in lease.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from server.tasks.records import TMP, Run, Task
from server.tasks.table import TaskTable

__all__ = ["HeldRows", "Takeover"]

log = logging.getLogger("server.tasks")

READ_RETRIES = (0.2, 0.5, 1.0, 2.0)
"""Seconds before each new try of the `held_by` read when it fails (the database just came back)."""


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
        """This instance's lease had expired (it has registered again by now): the others marked
        the tasks it was running then interrupted (and may run them now). Stop those here (their
        final writes are refused anyway); a task started since, whose row is still this
        instance's, runs on. The runs are taken now, each with its start row's commit: a run
        whose row was not queued yet (run.started None) is written after the new registration,
        so it is not looked at."""
        runs = [
            (t, t.run, t.run.started)
            for t in self.table.running()
            if t.kind != TMP and t.run is not None and t.run.started is not None  # (TMP tasks have no row)
        ]
        if runs:
            task = asyncio.create_task(self._stop_taken(runs), name="lease-lost")
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    async def _stop_taken(self, runs: list[tuple[Task, Run, asyncio.Future[Any]]]) -> None:
        """Stop those of `runs` whose rows this instance no longer holds, as "interrupted": first
        the runs whose start rows are committed, then each of the others once its row is (a row
        that failed to commit: that run is undone by its start, nothing to stop)."""
        ready = [(t, run) for t, run, started in runs if started.done()]
        waiting = {started: (t, run) for t, run, started in runs if not started.done()}
        if ready:
            await self._stop_unheld(ready)
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            await self._stop_unheld([waiting.pop(f) for f in done if not f.cancelled() and f.exception() is None])

    async def _stop_unheld(self, runs: list[tuple[Task, Run]]) -> None:
        """Abort, as "interrupted", the runs (still the tasks' own) whose rows this instance does
        not hold (committed rows: `held_by` tells)."""
        runs = [(t, run) for t, run in runs if t.running and t.run is run]  # (one that settled meanwhile is left alone)
        if not runs:
            return
        ids = [t.id for t, _ in runs]
        held: set[str] | None = None
        for pause in (*READ_RETRIES, None):
            try:
                held = await self.store.held_by(ids, self.instance)
                break
            except Exception as exc:
                if pause is None:  # the database stays away: stop them all, as is safe
                    log.warning("after the lease expired, could not read which tasks are still ours (%s)", exc)
                    break
                await asyncio.sleep(pause)
        taken = [t for t, run in runs if (held is None or t.id not in held) and t.running and t.run is run]
        if taken:
            log.warning(
                "instance %s: stopping %d run(s) of task(s) another instance took over while its lease had "
                "expired (they end interrupted here): %s",
                self.instance,
                len(taken),
                sorted(t.id for t in taken),
            )
        for t in taken:
            t.interrupted = True
            self.abort(t)
