"""The state queries of the task database: the stored states (`states` rows: a state's encoded
blob with its checksum, metadata and size), a state written behind its task's row, the least
recently used order and the byte budget, in SQLAlchemy Core that SQLite and PostgreSQL both run.

`StateStore` runs them over the Database's transactions (its write lock and errors); a Store owns
one as `Store.states`. A state written behind its task's row and the row's pointer to it are one
transaction (`store_state`), as are a task row and its state in Store's writes (`save`,
`insert_new`): those share this module's helpers (`has_state`, `drop_state_if_unused`). A states
row is made by `state_row`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from server.tasks.codec import EncodedState
from server.tasks.database import Database
from server.tasks.schema import INSERT_STATE, DbRow, states, tasks

_CHUNK = 500  # ids per IN (...) list


class StateStore:
    """The state queries of the task database (`db`: its transactions and write lock)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def get_state(self, state_id: str) -> DbRow | None:
        async with self.db.read() as conn:
            if not self.db.is_sqlite:  # its blob's bytes given the time a write of them has (pgconnect)
                size = (await conn.execute(sa.select(states.c.nbytes).where(states.c.id == state_id))).scalar()
                await self.db.allow(conn, written=int(size or 0))
            q = sa.select(
                states.c.meta,
                states.c.data,
                states.c.checksum,
                states.c.signature,
                states.c.nbytes,
                states.c.is_template,
            ).where(states.c.id == state_id)
            return (await conn.execute(q)).first()

    async def store_state(self, task_id: str, state: dict[str, Any], pos: int) -> tuple[bool, int]:
        """Write a state behind its task's row: insert it and point the row at it (state_pos =
        pos), dropping the state the row named before if no task names it any more. Skipped
        when the row is gone or already names a state of a longer history (histories only
        grow). Returns (stored, non-template state bytes dropped)."""
        async with self.db.write() as conn:
            q = sa.select(tasks.c.state_id, tasks.c.state_pos).where(tasks.c.id == task_id).with_for_update()
            cur = (await conn.execute(q)).first()
            if cur is None or (cur.state_id is not None and cur.state_pos > pos):
                return False, 0
            await self.db.allow(conn, written=len(state["data"]))  # a blob of megabytes: more time (pgconnect)
            await conn.execute(INSERT_STATE, state)
            await conn.execute(
                sa.update(tasks).where(tasks.c.id == task_id).values(state_id=state["id"], state_pos=pos)
            )
            dropped = await drop_state_if_unused(conn, cur.state_id) if cur.state_id else 0
            return True, dropped

    async def drop_state(self, state_id: str) -> int:
        """Delete a state (a corrupt one) and clear the rows that name it (state_pos 0: their
        next run rebuilds from zero). Returns the non-template bytes dropped."""
        async with self.db.write() as conn:
            row = (
                await conn.execute(sa.select(states.c.nbytes, states.c.is_template).where(states.c.id == state_id))
            ).first()
            await conn.execute(sa.update(tasks).where(tasks.c.state_id == state_id).values(state_id=None, state_pos=0))
            await conn.execute(sa.delete(states).where(states.c.id == state_id))
            return 0 if row is None or row.is_template else int(row.nbytes)

    async def touch_states(self, state_ids: Iterable[str], when: float | None = None) -> None:
        ids = list(state_ids)
        if not ids:
            return
        async with self.db.write() as conn:
            for i in range(0, len(ids), _CHUNK):
                await conn.execute(
                    sa.update(states).where(states.c.id.in_(ids[i : i + _CHUNK])).values(last_used=when or time.time())
                )

    async def states_bytes(self, templates: bool | None = False) -> int:
        q = sa.select(sa.func.coalesce(sa.func.sum(states.c.nbytes), 0))
        if templates is not None:
            q = q.where(states.c.is_template == templates)
        async with self.db.read() as conn:
            return int((await conn.execute(q)).scalar_one())

    async def states_count(self, templates: bool | None = False) -> int:
        """The number of stored states (non-template ones by default; None: all). Counted on
        the (is_template, last_used) index, so SQLite never reads the state blobs' pages."""
        q = sa.select(sa.func.count()).select_from(states)
        if templates is not None:
            q = q.where(states.c.is_template == templates)
        async with self.db.read() as conn:
            return int((await conn.execute(q)).scalar_one())

    async def enforce_budget(self, budget: int, keep: set[str], prefer: Iterable[str] = ()) -> tuple[list[str], int]:
        """Drop least recently used non-template states until they fit in `budget` bytes, never
        one in `keep`, one in `prefer` only when the others do not suffice; tasks that pointed
        at them keep their text (state_id NULL, state_pos 0).
        Returns (dropped state ids, non-template state bytes left)."""
        async with self.db.write() as conn:
            nt = states.c.is_template == sa.false()
            q = sa.select(sa.func.coalesce(sa.func.sum(states.c.nbytes), 0)).where(nt)
            total = int((await conn.execute(q)).scalar_one())
            if total <= budget:
                return [], total
            victims: list[str] = []
            before = total
            prefer = set(prefer)
            rows = (
                await conn.execute(
                    sa.select(states.c.id, states.c.nbytes).where(nt).order_by(states.c.last_used, states.c.created_at)
                )
            ).all()
            for r in [r for r in rows if r.id not in prefer] + [r for r in rows if r.id in prefer]:
                if total <= budget:
                    break
                if r.id in keep:
                    continue
                victims.append(r.id)
                total -= int(r.nbytes)
            await self.db.allow(conn, dropped=before - total)  # their blobs' pages deleted: more time (pgconnect)
            dropped: list[str] = []
            for i in range(0, len(victims), _CHUNK):
                # locked first (PostgreSQL; SQLite's write lock is the file's): a row another
                # replica's budget check dropped meanwhile is not there any more, nor counted here
                chunk = victims[i : i + _CHUNK]
                lock = sa.select(states.c.id).where(states.c.id.in_(chunk)).with_for_update()
                there = {r.id for r in await conn.execute(lock)}
                part = [v for v in chunk if v in there]  # (least recently used first, as chosen)
                await conn.execute(sa.delete(states).where(states.c.id.in_(part)))
                await conn.execute(
                    sa.update(tasks).where(tasks.c.state_id.in_(part)).values(state_id=None, state_pos=0)
                )
                dropped += part
            return dropped, total


def state_row(state_id: str, task_id: str, enc: EncodedState, is_template: bool) -> dict[str, Any]:
    """The states row of an encoded state (stored now: created_at = last_used = now)."""
    now = time.time()
    return {
        "id": state_id,
        "task_id": task_id,
        "is_template": is_template,
        "signature": enc.signature,
        "meta": orjson.dumps(enc.meta).decode(),
        "nbytes": enc.nbytes,
        "checksum": enc.checksum,
        "data": enc.data,
        "created_at": now,
        "last_used": now,
    }


async def has_state(conn: AsyncConnection, state_id: str, checksum: str) -> bool:
    """In a transaction: a state of this id and checksum is stored."""
    q = sa.select(states.c.id).where(states.c.id == state_id, states.c.checksum == checksum)
    return (await conn.execute(q)).first() is not None


async def drop_state_if_unused(conn: AsyncConnection, state_id: str) -> int:
    """In a write transaction: delete a state no task names; returns its bytes if it was a
    non-template one, else 0."""
    used = sa.select(tasks.c.id).where(tasks.c.state_id == state_id).exists()
    row = (
        await conn.execute(sa.select(states.c.nbytes, states.c.is_template).where(states.c.id == state_id).where(~used))
    ).first()
    if row is None:
        return 0
    await conn.execute(sa.delete(states).where(states.c.id == state_id))
    return 0 if row.is_template else int(row.nbytes)
