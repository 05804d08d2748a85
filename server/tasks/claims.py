"""The claim row of a template being made (TaskManager.as_template), in the database.

`Persistence.claim_id` inserts it before the template is filled: running, on the instance that
makes it, version 0 (no run ever claimed it: a continue of a template claims it, version 1 on),
so that no replica takes the name meanwhile. The template's row and its state then replace it in
one transaction (`settle_claim`), so a template is whole or not there. A claim is never listed
(`unmade`); it is deleted, not marked interrupted, once its instance is dead (`drop_unmade`, by a
start or a replica's lease reaper: server.tasks.lease), and by its maker when the template could
not be made (`drop_claim`). A claim row never names a state.
"""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from server.tasks.schema import INSERT_STATE, tasks

log = logging.getLogger("server.tasks")
FINISHED = 3
_CHUNK = 500  # ids per IN (...) list


class Writes(Protocol):
    """What the claims need of the database (server.tasks.store.Store): its write transaction.
    Typed here, not imported, as store.py imports this module."""

    def write(self) -> AbstractAsyncContextManager[AsyncConnection]: ...


def unmade() -> sa.ColumnElement[bool]:
    """A claim row: a template whose as_template has not answered (templates.being_made)."""
    return sa.and_(tasks.c.kind == "template", tasks.c.status != FINISHED, tasks.c.version == 0)


async def drop_unmade(conn: AsyncConnection, ids: list[str]) -> None:
    """In a write transaction: delete the claims `ids` of dead instances (their as_template was
    never answered): such a template is not there, as if it had never been asked for."""
    if ids:
        log.warning("%d template(s) a stopped server was making deleted (never answered): %s", len(ids), ids)
    for i in range(0, len(ids), _CHUNK):
        await conn.execute(sa.delete(tasks).where(tasks.c.id.in_(ids[i : i + _CHUNK]), unmade()))


async def settle_claim(store: Writes, row: dict[str, Any], state: dict[str, Any] | None, instance: str) -> bool:
    """One transaction: `state` inserted and `instance`'s claim of row["id"] replaced by `row`
    (the finished template). False, nothing written, when the claim is gone: this instance's
    lease had expired and a replica deleted it (the name may be another template's by now)."""
    async with store.write() as conn:
        q = sa.select(tasks.c.id).where(tasks.c.id == row["id"], tasks.c.instance == instance, unmade())
        if (await conn.execute(q.with_for_update())).first() is None:
            return False
        if state is not None:
            await conn.execute(INSERT_STATE, state)
        values = {k: v for k, v in row.items() if k != "id"}
        await conn.execute(sa.update(tasks).where(tasks.c.id == row["id"]).values(**values))
        return True


async def drop_claim(store: Writes, task_id: str, instance: str) -> None:
    """Delete `instance`'s claim of task_id (a template it could not make), never anything else:
    not a template a replica made under that name since this instance's lease expired."""
    async with store.write() as conn:
        await conn.execute(sa.delete(tasks).where(tasks.c.id == task_id, tasks.c.instance == instance, unmade()))
