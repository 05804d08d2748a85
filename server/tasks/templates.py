"""Making a new template (TaskManager.as_template, by a `TemplateMaker`): its name checked (a
key's public `_<name>` and private `_<name>@<owner>` are one name, never both), its id reserved
here and claimed in the database, then filled: given a stored state that has consumed all but
the last token of its history, before the template is answered.

The template's row and its state are committed in ONE transaction, the row finished, so a
template is either whole or not there (an unanswered as_template leaves nothing usable): until
then its only row is its claim (server.tasks.claims: never listed, deleted once its instance is
dead). Hence the prefill of a history whose state is not at hand is an engine request of its
own, not a run of the template (a run commits its row finished before its state is written
behind, and a crash between the two would leave a template without a state).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from array import array
from typing import TYPE_CHECKING, Protocol, cast

from server.engine.prefill import prefill_state
from server.engine.protocol import EngineAPI
from server.tasks.cache import StateCache
from server.tasks.claims import drop_claim, settle_claim
from server.tasks.codec import encode_state
from server.tasks.errors import TaskConflict, TaskInvalid
from server.tasks.imports import name_issue
from server.tasks.lineage import base_of
from server.tasks.output import Output
from server.tasks.params import inherited
from server.tasks.persist import Persistence
from server.tasks.records import FINISHED, PREFILL, TEMPLATE, Task, display_id, new_id, to_row
from server.tasks.statestore import state_row
from server.tasks.table import TaskTable

if TYPE_CHECKING:
    from server.model.state import State

__all__ = ["TemplateAccess", "TemplateMaker", "being_made", "check_name", "fill_template", "template_of"]

log = logging.getLogger("server.tasks")


def check_name(name: str | None) -> None:
    """TaskInvalid unless `name` (None: none given) may name a template."""
    issue = None if name is None else name_issue(name, new=True)
    if issue is not None:
        raise TaskInvalid(f"template name: {issue}", param="name")


class TemplateAccess(Protocol):
    """What making a template needs of the access rules (server.tasks.access.Access)."""

    async def find(self, task_id: str) -> Task | None: ...

    def finished(self, src: Task, what: str) -> None: ...


class TemplateMaker:
    """Makes the template of a finished task: the name checks, the id reserved in the table and
    claimed in the database, the fill, and the clean-up of a template that could not be made."""

    def __init__(
        self,
        access: TemplateAccess,
        table: TaskTable,
        cache: StateCache[State],
        persistence: Persistence,
        engine: EngineAPI,
    ) -> None:
        self.access, self.table, self.cache = access, table, cache
        self.persistence, self.engine = persistence, engine

    async def make(self, src: Task, oid: str | None, name: str | None, public: bool) -> Task:
        """TaskManager.as_template of the caller's task `src` (its name checked: check_name; its
        stopping run settled), for the owner hash `oid`; answered once its state is stored."""
        self.access.finished(src, "make a template of")
        live = self.table.live
        public = public or oid is None
        tid = new_id(TEMPLATE, name, None if public else oid)
        # the name is taken by this key's own template of it, private or public: a private one
        # shadows the public one (Access.lookup), from this key too (docs/task-api.md, 409)
        other = None if name is None or oid is None else new_id(TEMPLATE, name, oid if public else None)
        taken = f"template {display_id(tid)!r} already exists"
        if other is not None and await self._own_template(other, oid):
            raise TaskConflict(f"{taken} ({'private' if public else 'public'})", param="name")
        if tid in live or await self.access.find(tid) is not None or tid in live:
            raise TaskConflict(taken, param="name")
        if other is not None and (made := live.get(other)) is not None and made.owner == oid:
            raise TaskConflict(f"{taken} ({'private' if public else 'public'})", param="name")  # made meanwhile
        tpl = template_of(src, tid, oid, public)
        live[tid] = tpl  # reserves the id here (no await since the check above)
        claimed = False
        try:
            await self.persistence.claim_id(tpl)  # and in the database (another server may race)
            claimed = True
            await fill_template(tpl, src, self.persistence, self.engine)
        except BaseException:
            self.table.forget(tid)
            tpl.deleted = True
            if tpl.state_id and tpl.state_id.startswith(tid + ":"):
                self.cache.discard(tpl.state_id)
            if claimed:
                await self._drop_claim(tpl)
            raise
        self.table.retire(tpl)  # its truth is its row now (another server may delete it)
        return tpl

    async def _own_template(self, tid: str, oid: str | None) -> bool:
        """True when the template tid (being made here included) is oid's own."""
        t = await self.access.find(tid)  # (memory first: the live set holds one being made)
        return t is not None and not t.deleted and t.owner == oid

    async def _drop_claim(self, t: Task) -> None:
        """Delete the row claim_id inserted for a template that could not be made (best effort:
        a claim left behind is deleted once this instance is gone: server.tasks.claims)."""
        p = self.persistence
        try:
            await p.writer.call(drop_claim, p.store, t.id, p.instance)
        except Exception as exc:
            log.warning("template %s: could not delete its unfinished row: %s", t.id, exc)


def template_of(src: Task, tid: str, owner: str | None, public: bool) -> Task:
    """A new template `tid` with the finished task's history, text and parameters (less a
    `max_tokens` of 0: forks of it generate), running until fill_template gives it its state."""
    params = inherited(src.params)
    if params.get("max_tokens") == 0:
        del params["max_tokens"]
    tpl = Task(
        id=tid,
        kind=TEMPLATE,
        owner=owner,
        parent_id=src.id,
        public=public,
        params=params,
        prompt=src.prompt,
        prompt_len=src.prompt_len,
        tokens=array("i", src.tokens),
        out_start=src.out_start,
        out=Output(src.out.text, src.out.offsets),
        finish_reason=src.finish_reason,
        prompt_tokens=src.prompt_tokens,
        completion_tokens=src.completion_tokens,
        prefill_time=src.prefill_time,
        gen_time=src.gen_time,
        base_id=base_of(src),
        status=PREFILL,  # shown running until fill_template has stored it
    )
    tpl.out.finish_reason = src.finish_reason
    return tpl


def being_made(t: Task) -> bool:
    """t is a template whose as_template has not answered (its row: a claim, claims.unmade)."""
    return t.kind == TEMPLATE and t.running and t.version == 0


async def fill_template(tpl: Task, src: Task, persistence: Persistence, engine: EngineAPI) -> None:
    """The source's state when it is at hand, else the state after prefilling the template's
    history once (forks then start at no cost); then the template's row, finished, and that
    state in one transaction. The template shows running (status 0) here meanwhile."""
    tpl.instance = persistence.instance
    state, pos, key = await persistence.resolve_state(src)
    try:
        if state is None or pos < len(src.tokens) - 1:
            state, pos = await _prefill(engine, tpl, state, pos, persistence)
        await _store(tpl, state, pos, persistence)
    finally:
        persistence.release(key)


async def _prefill(
    engine: EngineAPI, tpl: Task, state: State | None, pos: int, persistence: Persistence
) -> tuple[State | None, int]:
    """The state after tpl.tokens[:-1], fed from `state` (which consumed tokens[:pos]; None: the
    zero state). The last token stays pending: a fork feeds it first, for its logits."""
    inp = tpl.tokens[pos:-1].tolist()
    if not inp:
        return state, pos
    filled = await prefill_state(
        engine,
        inp,
        init_state=state,
        request_id=f"{tpl.id}.fill",
        history=len(inp),  # the source's own history: not counted as a request's prompt
        what=f"the prefill of template {tpl.display_id}",
    )
    # (the engine's states are model States; fakes in the tests give their own)
    c = persistence.counters
    c["prefill_tokens"] += len(inp)
    c["rebuilds"] += 1
    c["rebuild_tokens"] += len(inp)
    return cast("State", filled), pos + len(inp)


async def _store(tpl: Task, state: State | None, pos: int, persistence: Persistence) -> None:
    """tpl's row, finished, and its state (None: a history of one token, from the zero state)
    in one transaction, over its claim (TaskConflict when a replica took the claim)."""
    srow = None
    if state is not None:
        sid = f"{tpl.id}:{uuid.uuid4().hex[:12]}"
        tpl.state_id, tpl.state_pos = sid, pos
        persistence.cache.put(sid, state, template=True)
        states = persistence.states
        enc = await asyncio.to_thread(encode_state, state, states.signature, wkv_dtype=states.store_dtype)
        tpl.stored_id, tpl.stored_pos = sid, pos
        srow = state_row(sid, tpl.id, enc, True)
    row = {**to_row(tpl), "status": FINISHED, "instance": None}
    p = persistence
    if not await p.writer.call(settle_claim, p.store, row, srow, p.instance, fail_fast=True):
        raise TaskConflict(
            f"template {tpl.display_id} is gone: it was deleted while it was made (or this server's lease "
            "expired meanwhile and a replica dropped it); make it again",
            param="name",
        )
    tpl.status, tpl.instance = FINISHED, None  # shown finished once it is stored
