"""Write-behind of task states: a finished task is shown finished once its row is committed; its
new state is written afterwards, one state per transaction, by this lane.

Coalesced: a task has at most one pending state (a newer one replaces it). Bounded in memory:
the pending states' bytes stay under `max_bytes`; beyond, the oldest task states are dropped
from the lane (templates never): each stays in the state cache while the cache keeps it, and
once gone its task is rebuilt from its tokens (from its last stored state, or from zero).
Templates go first. The lane hands the writer one state at a time, so a row queued meanwhile
(a task that just finished, a new task) waits behind at most one state write; the next state is
encoded while the current one is committed (two encoded states in memory at most).

A transient failure (TaskUnavailable: a locked or full database) keeps the state pending and
retries after a back-off; any other failure drops it (logged): a state is a cache of its task's
tokens, so losing one costs a prefill, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from server.tasks.errors import TaskUnavailable
from server.tasks.records import Task

if TYPE_CHECKING:
    from server.model.state import State

log = logging.getLogger("server.tasks")
RETRY_MAX_S = 5.0
WRITTEN_POLL_S = 0.01


@dataclass(eq=False)
class Pending:
    """A state waiting to be written behind its task's row."""

    task: Task
    key: str
    state: State
    pos: int
    """Tokens of the task's history the state has consumed (the row's state_pos once written)."""
    template: bool
    nbytes: int
    attempts: int = 0
    prepared: asyncio.Future[Any] | None = field(default=None, repr=False)
    """Its encoding (prepare's result), started before its turn to be written."""


class StateLane:
    def __init__(
        self,
        prepare: Callable[[Pending], Awaitable[Any]],
        write: Callable[[Pending, Any], Awaitable[None]],
        drop: Callable[[Pending, str], None],
        *,
        max_bytes: int,
    ) -> None:
        """`prepare(p)`: encode p (run ahead of its turn); `write(p, prepared)`: commit it,
        point the row at it and release p; `drop(p, why)`: p will not be written (release what
        holds it in memory)."""
        self._prepare, self._write, self._drop = prepare, write, drop
        self.max_bytes = max(0, int(max_bytes))
        self._items: dict[str, Pending] = {}  # task id -> its pending state, oldest first
        self._current: Pending | None = None  # being written
        self.bytes = 0
        """Bytes of the pending states, the one being written included."""
        self.dropped = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="task-state-writer")

    def __len__(self) -> int:
        return len(self._items) + (self._current is not None)

    def add(self, p: Pending) -> None:
        """Queue p (replacing its task's older pending state); drop the oldest task states
        while the lane holds more than max_bytes."""
        old = self._items.pop(p.task.id, None)
        if old is not None:
            self._remove(old, "superseded")
        self._items[p.task.id] = p
        self.bytes += p.nbytes
        while self.bytes > self.max_bytes:
            victim = next((x for x in self._items.values() if not x.template), None)
            if victim is None:
                break
            del self._items[victim.task.id]
            self._remove(victim, "over the write-behind budget")
        self._idle.clear()
        self._wake.set()

    def discard(self, task_id: str) -> None:
        """Forget the pending state of a task (deleted)."""
        p = self._items.pop(task_id, None)
        if p is not None:
            self._remove(p, "task deleted")
        self._settle_idle()

    async def idle(self) -> None:
        """Until nothing is pending (everything written or dropped)."""
        await self._idle.wait()

    async def written(self, task_id: str, timeout: float) -> bool:
        """Until the task's pending state, if any, is written or dropped (polled: a rare wait);
        False after `timeout` seconds."""
        end = asyncio.get_running_loop().time() + timeout
        while task_id in self._items or (self._current is not None and self._current.task.id == task_id):
            if asyncio.get_running_loop().time() >= end:
                return False
            await asyncio.sleep(WRITTEN_POLL_S)
        return True

    async def drain(self, timeout: float) -> None:
        """Write what can be written within `timeout` seconds, drop the rest, stop."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning(
                "state writes: %d states (%.1f MiB) not written at shutdown; their tasks "
                "will be rebuilt from their tokens",
                len(self),
                self.bytes / 2**20,
            )
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for p in list(self._items.values()):
            self._remove(p, "shutdown")
        self._items.clear()

    def stats(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "entries": len(self), "dropped": self.dropped}

    # --- internals -----------------------------------------------------------------------------
    def _remove(self, p: Pending, why: str) -> None:
        fut, p.prepared = p.prepared, None
        if fut is not None:
            fut.cancel()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.bytes -= p.nbytes
        self.dropped += why != "superseded"
        try:
            self._drop(p, why)
        except Exception:
            log.exception("dropping the pending state of %s failed", p.task.id)

    def _peek(self) -> Pending | None:
        if not self._items:
            return None
        return next((x for x in self._items.values() if x.template), None) or next(iter(self._items.values()))

    def _next(self) -> Pending:
        p = self._peek()
        assert p is not None
        del self._items[p.task.id]
        return p

    async def _write_one(self, p: Pending) -> None:
        """Encode p (unless done ahead), start encoding the next one, commit p."""
        if p.prepared is None:
            p.prepared = asyncio.ensure_future(self._prepare(p))
        nxt = self._peek()
        if nxt is not None and nxt.prepared is None:
            nxt.prepared = asyncio.ensure_future(self._prepare(nxt))
        try:
            prepared = await p.prepared
        except BaseException:
            p.prepared = None
            raise
        await self._write(p, prepared)

    def _settle_idle(self) -> None:
        if not self._items and self._current is None:
            self._idle.set()

    async def _loop(self) -> None:
        while True:
            if not self._items:
                self._settle_idle()
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._write_next()

    async def _write_next(self) -> None:
        """Write (or retry, or drop) the next pending state. A method of its own so that the
        Pending and its state are let go when it returns: a local of _loop would keep the last
        one (MBs, outside every budget) while the lane waits for the next."""
        p = self._current = self._next()
        outcome = "written"
        try:
            await self._write_one(p)
        except asyncio.CancelledError:
            self._current = None
            self._remove(p, "shutdown")
            raise
        except TaskUnavailable as exc:
            p.attempts += 1
            outcome = "retry"
            log.warning("state write of %s failed (%s); retrying", p.task.id, exc.message)
        except Exception:
            outcome = "failed"
            log.exception("state write of %s failed; its task will be rebuilt from its tokens", p.task.id)
        if outcome == "retry":
            await asyncio.sleep(min(RETRY_MAX_S, 0.05 * 2**p.attempts))  # still _current
            self._current = None
            if p.task.id not in self._items and not p.task.deleted:
                self._items = {p.task.id: p, **self._items}  # first again: the oldest
                return
            self._remove(p, "superseded while retrying")
        elif outcome == "failed":
            self._current = None
            self._remove(p, "write failed")
        else:  # written: write() released it
            self._current = None
            p.prepared = None
            self.bytes -= p.nbytes
