"""Where a task's token history starts, for the rebuild of a lost state.

A task's history normally starts at the zero state, so a missing state is rebuilt by feeding the
history from the zero state. A template made from a state file (server.tasks.imports) has no such
history: its state is its only truth, and the histories of its forks (and of their forks and
templates) start at that state. Rebuilding one of those from the zero state would silently give
another state; `state_base` finds the template whose state they start from instead.

Each task records that template as `base_id` (schema v4), given at fork and as_template time:
the id of the template's STATE it started from (`<template id>:<hex>`, see `base_of`), so that a
template of the same name made later (deleted and uploaded again, or an operator's `--state` of
another file at a restart) is never taken for it: its state id differs, and the rebuild is
refused (TaskStateLost). A state file's template names its state by its content (imports.py),
so the same file loaded again is the same base. A base_id of a bare template id (recorded
before the state was part of it) trusts whichever template has that id now, as it always did.
A row written before v4 has none: its base is found through `parent_id`, which a deleted
ancestor breaks (such a task is rebuilt from the zero state, as before v4).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import NamedTuple

from server.tasks.records import TEMPLATE, Task

STATE_ORIGIN = "state:"
"""parent_id prefix of a template made from a state (imports.STATE_OPERATOR, STATE_UPLOAD)."""
MAX_DEPTH = 10_000  # forks of forks: a bound against a cycle in damaged rows


def is_state_only(t: Task) -> bool:
    """The template's state is its only truth (made from a state, not from a token history)."""
    return t.kind == TEMPLATE and (t.parent_id or "").startswith(STATE_ORIGIN)


def base_of(src: Task) -> str | None:
    """The base_id of a fork or template of `src`: the state of the state-file template its
    history starts from (a task id never holds ':', a state id is `<task id>:<hex>`)."""
    if not is_state_only(src):
        return src.base_id
    sid = src.state_id
    return sid if sid is not None and sid.startswith(src.id + ":") else src.id


def split_base(base_id: str) -> tuple[str, str | None]:
    """(template id, the id of its state the history starts from; None: not recorded)."""
    tid, sep, _ = base_id.partition(":")
    return tid, base_id if sep else None


class Base(NamedTuple):
    """Where a history starts: `template` (None: it is gone) when `from_template`, else zero.
    `state_id`: the template's state it starts from (None: recorded before it was)."""

    from_template: bool
    template: Task | None = None
    template_id: str | None = None
    state_id: str | None = None


async def state_base(t: Task, lookup: Callable[[str], Awaitable[Task | None]]) -> Base:
    """Where t's history starts. `lookup(id)` reads a task, stored or live (None: gone)."""
    if is_state_only(t):
        return Base(True, t, t.id)
    if t.base_id is not None:
        return await _recorded(t.base_id, lookup)
    cur: Task | None = t  # a row from before v4: follow parent_id
    seen: set[str] = set()
    while cur is not None and cur.id not in seen and len(seen) < MAX_DEPTH:
        if is_state_only(cur):
            return Base(True, cur, cur.id)
        if cur.base_id is not None:
            return await _recorded(cur.base_id, lookup)
        seen.add(cur.id)
        parent = cur.parent_id
        if not parent or parent.startswith(STATE_ORIGIN):
            break
        cur = await lookup(parent)
    return Base(False)


async def _recorded(base_id: str, lookup: Callable[[str], Awaitable[Task | None]]) -> Base:
    tid, sid = split_base(base_id)
    return Base(True, await lookup(tid), tid, sid)


def base_state(base: Base) -> tuple[str, int] | str:
    """(state id, tokens it consumed) of the template's state the history starts from, or why
    there is none: the template was deleted, its state is lost, or it holds another state now
    (its name was reused, or it was continued)."""
    tpl = base.template
    if tpl is None:
        return "was deleted"
    if tpl.state_id is None and tpl.stored_id is None:
        return "is lost or corrupt"
    if base.state_id is None:  # recorded without its state: the template of that id now
        return (tpl.stored_id or tpl.state_id or ""), tpl.state_pos
    for sid, pos in ((tpl.state_id, tpl.state_pos), (tpl.stored_id, tpl.stored_pos)):
        if sid == base.state_id:
            return sid, pos
    return "holds another state now (its name was reused, or it was continued)"
