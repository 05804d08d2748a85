"""Reads of the task layer's database: a task's row, and the state a run starts from (with the
rules that rebuild a missing one). Persistence composes it (`Persistence.reads`) and forwards
`load_task` and `resolve_state`; a state it pins is unpinned by `Persistence.release`.

A state that is missing when a run starts (not written yet at a crash, dropped by a budget,
failing its checksum, undecodable) is rebuilt: the run feeds the history from the last stored
state, or from zero, or from the state of the template its history starts at (that one cannot
be rebuilt from tokens: TaskStateLost). Only a state of another model shape is refused (the task
was made with another model: TaskConflict).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import orjson

from server.tasks.codec import StateCodecError, StateShapeError, decode_state
from server.tasks.database import damaged
from server.tasks.errors import TaskConflict, TaskStateLost
from server.tasks.lineage import base_state, state_base
from server.tasks.records import Task, complete_interrupted, display_id, from_row
from server.tasks.statewrites import StateWrites

if TYPE_CHECKING:
    from server.model.state import State

log = logging.getLogger("server.tasks")


class StateReads:
    def __init__(
        self,
        states: StateWrites,
        *,
        url_of: Callable[[str | None], str | None] = lambda _: None,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        """Shares `states`' store, writer, cache, table, counters and model signature (a corrupt
        state is dropped through `states`). url_of: an instance's URL, for the error of a task
        running elsewhere; decode: the tokenizer's, to complete an interrupted task's text."""
        self.states = states
        self.store, self.writer, self.cache, self.table = states.store, states.writer, states.cache, states.table
        self.counters, self.signature = states.counters, states.signature
        self.url_of, self.decode = url_of, decode

    async def load_task(self, task_id: str) -> Task | None:
        """The stored task (kept as recently read when finished), or the copy loaded meanwhile.
        A row still running elsewhere is not kept: its progress changes under it; its output is
        closed here with an error naming the instance, so a stream of it ends at once (its
        instance streams it)."""
        ticket = self.table.read_ticket()
        row = await self.store.get_task(task_id)
        if self.table.stale(task_id, ticket):
            return None  # deleted meanwhile: the row read is gone (TaskTable's fence)
        if row is None:
            return self.table.find(task_id)
        t = from_row(row)
        if not t.running:
            if t.finish_reason == "interrupted" and self.decode is not None:
                complete_interrupted(t, self.decode)
            return self.table.remember(t)
        t.out.finished = True
        where = f"instance {t.instance!r}" + (f" ({self.url_of(t.instance)})" if self.url_of(t.instance) else "")
        t.out.error = f"task {t.display_id} is running on {where}; stream it there"
        return t

    async def resolve_state(self, t: Task, holder: str | None = None) -> tuple[State | None, int, str | None]:
        """(state, state_pos, pinned key) to start t's next run from: its newest state, else
        its last stored one, else (None, 0, None): the run rebuilds from zero. holder: the task
        a TaskStateLost names (default t; a new fork names its source, whose state it copied)."""
        tried: set[str] = set()
        while t.state_id and t.state_id not in tried:
            sid, pos = t.state_id, t.state_pos
            tried.add(sid)
            st = await self.cache.get_or_load(sid, partial(self._load_state, sid))
            if t.state_id != sid:
                continue  # it changed while loading
            if st is not None:
                self.cache.pin(sid, st)
                return st, pos, sid
            self.counters["state_misses"] += 1
            if t.stored_id == sid:
                t.stored_id, t.stored_pos = None, 0  # gone from the database too
            t.state_id, t.state_pos = t.stored_id, t.stored_pos
        return await self._resolve_base(t, tried, holder or t.display_id)

    async def _resolve_base(self, t: Task, tried: set[str], holder: str) -> tuple[State | None, int, str | None]:
        """t has no usable state of its own: (None, 0, None) rebuilds it from the zero state,
        unless its history starts at a state template's state (server.tasks.lineage): then from
        that very state, and TaskStateLost when it is gone (the template deleted, its state lost
        or corrupt, or its name now another state's)."""
        base = await state_base(t, self._lookup)
        if not base.from_template:
            return None, 0, None
        found = base_state(base)
        why = found if isinstance(found, str) else "is lost or corrupt"
        if not isinstance(found, str) and found[0] not in tried:
            sid, pos = found
            st = await self.cache.get_or_load(sid, partial(self._load_state, sid))
            if st is not None:
                self.cache.pin(sid, st)
                return st, pos, sid
        raise TaskStateLost(
            f"task {holder} starts from the state of template {display_id(base.template_id)}, which "
            f"{why} (and its own state is lost): it cannot be rebuilt from its tokens. Load that state file "
            "again (under its old name this task is rebuilt from it; under a new one, fork that)",
            param="task_id",
        )

    async def _lookup(self, task_id: str) -> Task | None:
        return self.table.find(task_id) or await self.load_task(task_id)

    async def _load_state(self, sid: str) -> State | None:
        """A stored state, decoded; None when there is none or it is unusable (corrupt,
        undecodable: it is dropped, and the task rebuilt). Another model's state: 409."""
        if sid.startswith("TMP_"):
            return None  # TMP states are never stored
        try:
            row = await self.store.states.get_state(sid)
        except Exception as exc:
            if not damaged(exc):
                raise
            log.error("stored state %s is on a damaged database page (%s); its task is rebuilt", sid, exc)
            self.counters["state_corrupt"] += 1
            return None
        if row is None:
            return None
        try:
            st = await asyncio.to_thread(_decode, row.meta, row.data, self.signature, row.checksum)
        except StateShapeError as exc:
            raise TaskConflict(str(exc)) from exc
        except StateCodecError as exc:
            log.warning("stored state %s is unusable (%s); its task is rebuilt from its tokens", sid, exc)
            self.counters["state_corrupt"] += 1
            self.writer.offer(self._drop_corrupt, sid)
            return None
        self.counters["db_state_loads"] += 1
        self.writer.offer(self.store.states.touch_states, [sid])  # budget eviction is least recently used
        if row.is_template and sid not in self.cache:
            self.cache.put(sid, st, template=True)
        return st

    async def _drop_corrupt(self, sid: str) -> None:
        self.states.dropped(await self.store.states.drop_state(sid))
        for x in self.table.held():
            if x.stored_id == sid:
                x.stored_id, x.stored_pos = None, 0


def _decode(meta: str, data: bytes, signature: str, checksum: str) -> State:
    try:
        parsed = orjson.loads(meta)
    except orjson.JSONDecodeError as exc:
        raise StateCodecError(f"stored state metadata is not JSON: {exc}") from None
    return decode_state(parsed, data, signature, checksum)
