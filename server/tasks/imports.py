"""A template made from a given state (a tuned state file, or a state exported by a server): the
task-layer operation behind `--state NAME=PATH` and the state upload / import route.

Such a template `_NAME` differs from one made by `as_template` in one way that matters: its state
is its only truth. It has no token history from the zero state (only the tokens the state has
not consumed yet: none for a tuned state, the exported task's pending tokens for an export), so
it can never be rebuilt by prefilling its history. It is marked by `parent_id` (STATE_OPERATOR
or STATE_UPLOAD, see `lineage.is_state_only`) so that the persistence layer can keep its rules:
never evict it from memory (templates live in the cache's template tier), never drop or defer
its stored state, and rebuild a lost state of a task descending from it from its state, never
from the zero state (server.tasks.lineage). Its row and state are committed before it is answered.
Its state's id names the state's content (`state_id_of`): forks record it as the base they start
from, so a later template of the same name with another state is never taken for it.

Forks of it behave as forks of any template: their history starts with the template's pending
tokens, their first run feeds those plus the prompt, starting from a copy of the state.

Built only on the TaskManager's public collaborators (its table, cache, persistence and `get` /
`delete`), the way `TaskManager.as_template` stores a template.
"""

from __future__ import annotations

import asyncio
import re
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from server.tasks.codec import encode_state
from server.tasks.errors import TaskConflict, TaskInvalid
from server.tasks.lineage import STATE_ORIGIN, is_state_only
from server.tasks.records import TEMPLATE, Task, new_id, to_row
from server.tasks.statestore import state_row

if TYPE_CHECKING:
    from server.model.state import State
    from server.tasks.manager import TaskManager
    from server.tasks.params import TaskParams

STATE_OPERATOR = STATE_ORIGIN + "operator"
"""parent_id of a template loaded by the operator at start (`--state`): public, replaced at each start."""
STATE_UPLOAD = STATE_ORIGIN + "upload"
"""parent_id of a template made from an uploaded state file (owned by the uploading API key)."""
__all__ = ["STATE_OPERATOR", "STATE_UPLOAD", "check_name", "is_state_only", "name_issue", "template_from_state"]
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
"""Template names (the same rule as `as_template`'s): no path separators, no leading dot."""
AUTO_NAME = re.compile(r"TMPL_[0-9a-fA-F]{32}")
"""The form of an unnamed template's id (`_TMPL_<32 hex>`): no name may take it."""


def name_issue(name: str, new: bool = False) -> str | None:
    """Why `name` cannot name a template (None: it can); `new`: a template to be made, which may
    not take an unnamed template's form (a lookup may: `"state": "TMPL_<hex>"` finds that one)."""
    if not NAME.fullmatch(name):
        return "use 1-64 letters, digits, '_', '-', '.' (starting with a letter or digit; no path separators)"
    if new and AUTO_NAME.fullmatch(name):
        return "TMPL_ and 32 hex digits is the form of an unnamed template's id"
    return None


def check_name(name: str, new: bool = False) -> str:
    """The template id `_<name>`; TaskInvalid for a name name_issue refuses."""
    issue = name_issue(name, new)
    if issue is not None:
        raise TaskInvalid(f"state name {name!r}: {issue}", param="name")
    return new_id(TEMPLATE, name)


async def template_from_state(
    tm: TaskManager,
    name: str,
    state: State,
    *,
    pending: Sequence[int] = (),
    owner: str | None = None,
    operator: bool = False,
    params: TaskParams | None = None,
) -> Task:
    """Make the read-only template `_<name>` holding `state` (batch 1, CPU; kept as given: the
    caller hands it over) and `pending` (tokens fed before a fork's prompt).

    operator=True: a start-up template (public, owner None); one of the same name made by an
    earlier start is replaced. Otherwise it belongs to `owner`. TaskConflict when the name is
    taken (by any other template), TaskInvalid for a bad name or token id."""
    check_name(name, new=True)
    oid = None if operator else tm.owner_id(owner)
    tid = new_id(TEMPLATE, name, oid)  # public when made by the operator or without keys; else `_name@key`
    bad = next((t for t in pending if not 0 <= int(t) < tm.vocab_size), None)
    if bad is not None:
        raise TaskInvalid(f"pending token id {bad} is outside the vocabulary [0, {tm.vocab_size})", param="pending")
    await _name_free(tm, tid, operator)
    tpl = Task(
        id=tid,
        kind=TEMPLATE,
        owner=oid,
        public=oid is None,
        parent_id=STATE_OPERATOR if operator else STATE_UPLOAD,
        params=params.copy() if params else {},
        tokens=array("i", [int(t) for t in pending]),
        out_start=len(pending),
        finish_reason="stop",
    )
    tpl.out.finish_reason = "stop"
    tm.live[tid] = tpl  # reserves the id (no await since _name_free's last check)
    await _persist(tm, tpl, state)
    tm.table.retire(tpl)  # its truth is its row now (another server may delete it)
    return tpl


async def _name_free(tm: TaskManager, tid: str, operator: bool) -> None:
    """TaskConflict when the template tid exists, unless it is the operator's file of an
    earlier start and `operator` loads it again: that one is deleted. Its last check reads the
    live set, so the caller reserves tid there before its next await."""
    old = await _existing(tm, tid)
    if old is not None:
        if not (operator and old.parent_id == STATE_OPERATOR):
            raise TaskConflict(f"template {tid!r} already exists; delete it first or pick another name", param="name")
        await tm.delete(tid, None, force=True)  # the operator's file of an earlier start
    if tid in tm.live:  # made meanwhile (the awaits above)
        raise TaskConflict(f"template {tid!r} already exists", param="name")


async def _persist(tm: TaskManager, tpl: Task, state: State) -> None:
    """Put tpl's state in the cache's template tier and insert its row and state in one
    transaction, committed before the template is answered. On failure (TaskConflict when
    another server of the database took the name meanwhile) tpl is forgotten, as never made."""
    tid, sid = tpl.id, None
    try:
        # stored exact (never the fp16 storage dtype): this state is the template's only truth
        enc = await asyncio.to_thread(encode_state, state, tm.signature)
        sid = state_id_of(tid, enc.checksum)
        tpl.state_id, tpl.state_pos = sid, 0
        tm.cache.put(sid, state, template=True)  # the template tier: never evicted
        tpl.stored_id, tpl.stored_pos = sid, 0
        p = tm.persistence
        # insert only: another server may have taken the name (the state row may be there
        # already: that of a deleted template of the same file)
        if not await p.writer.call(p.store.insert_new, to_row(tpl), state_row(sid, tid, enc, True), fail_fast=True):
            raise TaskConflict(f"template {tid!r} already exists", param="name")
    except BaseException:
        tm.table.forget(tid)
        tpl.deleted = True
        if sid is not None:
            tm.cache.discard(sid)
        raise


def state_id_of(tid: str, checksum: str) -> str:
    """The id of template tid's state, named by its content (the SHA-256 of its stored bytes):
    forks record it as their base (lineage.base_of), so a template of the same name with another
    state is never taken for theirs, while the same file loaded again is (`--state` at each
    start, or a delete and upload of the same file)."""
    return f"{tid}:{checksum[:32]}"


async def _existing(tm: TaskManager, tid: str) -> Task | None:
    t = await tm.access.find(tid)
    return None if t is None or t.deleted else t
