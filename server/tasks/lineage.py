"""Where a task's token history starts, for the rebuild of a lost state.

A task's history normally starts at the zero state, so a missing state is rebuilt by feeding the
history from the zero state. A template made from a state file (server.tasks.imports) has no such
history: its state is its only truth, and the histories of its forks (and of their forks and
templates) start at that state. Rebuilding one of those from the zero state would silently give
another state; `state_base` finds the template whose state they start from instead.

Each task records that template as `base_id` (schema v4), given at fork and as_template time.
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
    """The base_id of a fork or template of `src`."""
    return src.id if is_state_only(src) else src.base_id


class Base(NamedTuple):
    """Where a history starts: `template` (None: it is gone) when `from_template`, else zero."""

    from_template: bool
    template: Task | None = None
    template_id: str | None = None


async def state_base(t: Task, lookup: Callable[[str], Awaitable[Task | None]]) -> Base:
    """Where t's history starts. `lookup(id)` reads a task, stored or live (None: gone)."""
    if is_state_only(t):
        return Base(True, t, t.id)
    if t.base_id is not None:
        return Base(True, await lookup(t.base_id), t.base_id)
    cur: Task | None = t  # a row from before v4: follow parent_id
    seen: set[str] = set()
    while cur is not None and cur.id not in seen and len(seen) < MAX_DEPTH:
        if is_state_only(cur):
            return Base(True, cur, cur.id)
        if cur.base_id is not None:
            return Base(True, await lookup(cur.base_id), cur.base_id)
        seen.add(cur.id)
        parent = cur.parent_id
        if not parent or parent.startswith(STATE_ORIGIN):
            break
        cur = await lookup(parent)
    return Base(False)
