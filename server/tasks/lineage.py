"""Where a task's token history starts, for the rebuild of a lost state.

A task's history normally starts at the zero state, so a missing state is rebuilt by feeding the
history from the zero state. A template made from a state file (server.tasks.imports) has no such
history: its state is its only truth, and the histories of its forks (and of their forks and
templates) start at that state. Rebuilding one of those from the zero state would silently give
another state; `state_base` finds the template whose state they start from instead.

The lineage is followed through `parent_id`. A chain broken by a deleted ancestor cannot be
followed: such a task is rebuilt from the zero state, as before (the task row does not record its
base; docs/deployment.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from server.tasks.records import TEMPLATE, Task

STATE_ORIGIN = "state:"
"""parent_id prefix of a template made from a state (imports.STATE_OPERATOR, STATE_UPLOAD)."""
MAX_DEPTH = 10_000  # forks of forks: a bound against a cycle in damaged rows


def is_state_only(t: Task) -> bool:
    """The template's state is its only truth (made from a state, not from a token history)."""
    return t.kind == TEMPLATE and (t.parent_id or "").startswith(STATE_ORIGIN)


async def state_base(t: Task, lookup: Callable[[str], Awaitable[Task | None]]) -> Task | None:
    """The state-only template t's history starts from (t itself when it is one), or None: the
    zero state (or an ancestor that is gone). `lookup(id)` reads a task, stored or live."""
    cur: Task | None = t
    seen: set[str] = set()
    while cur is not None and cur.id not in seen and len(seen) < MAX_DEPTH:
        if is_state_only(cur):
            return cur
        seen.add(cur.id)
        parent = cur.parent_id
        if not parent or parent.startswith(STATE_ORIGIN):
            return None
        cur = await lookup(parent)
    return None
