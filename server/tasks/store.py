"""The task database: SQLAlchemy 2 async (aiosqlite by default; any async URL, e.g. asyncpg).

The connection (WAL + synchronous=FULL on SQLite, so an acknowledged task survives a power
loss; IMMEDIATE write transactions; transient errors as TaskUnavailable, HTTP 503): database.py.
The list's page, filters and prompt search: listing.py. The state queries (the stored states, a
state written behind its row, the byte budget): statestore.py, owned here as `Store.states`. All
SQL here is plain SQLAlchemy Core that PostgreSQL runs too.

Run writes of existing rows are fenced: a claim (`claim`) moves a finished row to this instance
only if nobody else runs it and it is the version this server read; later writes of the run
(`update_owned`) touch only rows this instance still holds. Instance leases: server/tasks/lease.py.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from server.tasks.claims import drop_unmade, unmade
from server.tasks.database import Database, database_url, unavailable
from server.tasks.names import lock_name, name_free
from server.tasks.schema import INSERT_STATE, DbRow, states, tasks
from server.tasks.statestore import StateStore, drop_state_if_unused, has_state

__all__ = [
    "ClaimMiss",
    "Database",
    "RowHeld",
    "Store",
    "TagTaken",
    "database_url",
    "unavailable",
]

_CHUNK = 500  # ids per IN (...) list
FINISHED = 3
Row = dict[str, Any]  # a row's values by column name


class TagTaken(Exception):
    """A row's tag is another row's of the same owner (ux_tasks_named): nothing was written."""


class RowHeld(Exception):
    """The row runs on another instance (its lease holds it): not changed here."""

    def __init__(self, instance: str | None) -> None:
        super().__init__(f"the row runs on instance {instance!r}")
        self.instance = instance


class ClaimMiss(NamedTuple):
    """Why a claim failed: the row as it is (status None: the row is gone)."""

    status: int | None
    version: int | None
    instance: str | None


class Store(Database):
    """Task queries (the connection, locking and errors: Database; the list: listing.Listing; the
    state queries: `states`, a statestore.StateStore over this store's transactions)."""

    def __init__(self, db: str, *, busy_timeout: float = 30.0) -> None:
        super().__init__(db, busy_timeout=busy_timeout)
        self.states = StateStore(self)

    # --- tasks ---------------------------------------------------------------------------------
    async def save(self, task_row: Row | None = None, state: Row | None = None, drop_states: Iterable[str] = ()) -> int:
        """One transaction: insert `state` (a states row), upsert `task_row`, then drop the
        states in `drop_states` that no task references any more. Returns the non-template
        state bytes dropped."""
        async with self.write() as conn:
            return await _save_one(self, conn, task_row, state, drop_states)

    async def save_each(
        self, items: AsyncIterator[tuple[dict[str, Any] | None, dict[str, Any] | None, Iterable[str]]]
    ) -> int:
        """save(task_row, state, drop_states) for each item `items` yields, all in ONE
        transaction (items are taken one at a time, so they may be produced lazily)."""
        dropped = 0
        async with self.write() as conn:
            async for task_row, state, drop_states in items:
                dropped += await _save_one(self, conn, task_row, state, drop_states)
        return dropped

    async def insert_new(self, task_row: dict[str, Any], state: dict[str, Any] | None = None) -> bool:
        """Insert a new task row (and its state) in one transaction unless a row with its id
        exists: False then, and nothing is written. For ids that are names (templates), which
        two servers of one database may pick at once: the first commit wins. A key's template
        whose name the key's other template has (public `_name`, private `_name@<owner>`):
        TaskConflict, nothing written (names.name_free). A state whose id names its content
        (imports.state_id_of) may be stored already, with the same checksum: it is kept (the
        forks of a deleted template of the same file still name it)."""
        try:
            async with self.write() as conn:
                await lock_name(conn, task_row)
                q = sa.select(tasks.c.id).where(tasks.c.id == task_row["id"])
                if (await conn.execute(q)).first() is not None:
                    return False
                await name_free(conn, task_row)
                if state is not None and not await has_state(conn, state["id"], state["checksum"]):
                    await self.allow(conn, written=len(state["data"]))  # (a state file's blob)
                    await conn.execute(INSERT_STATE, state)
                await conn.execute(sa.insert(tasks), [task_row])
        except sa.exc.IntegrityError:  # inserted by another server since the check
            return False
        return True

    async def save_rows(self, rows: list[dict[str, Any]]) -> None:
        """Upsert whole task rows (to_row's columns) in one transaction (_upsert_rows). The same
        id twice: the later row wins, as if the rows were saved one after the other."""
        if not rows:
            return
        try:
            async with self.write() as conn:
                await _upsert_rows(conn, rows)
        except sa.exc.IntegrityError as exc:
            if "ux_tasks_named" in str(exc):
                raise TagTaken(str(exc.orig)) from None
            raise

    async def save_progress(self, rows: list[dict[str, Any]]) -> None:
        """Update existing task rows (all with the same columns), one transaction and one
        executemany; rows no longer in the table (deleted) are left alone."""
        if not rows:
            return
        async with self.write() as conn:
            await _update_rows(conn, rows)

    async def update_owned(self, rows: list[dict[str, Any]], instance: str) -> set[str]:
        """Update the rows (same columns) that `instance` still runs (tasks.instance), in one
        transaction; returns the ids it does not (deleted, or marked interrupted by a replica
        after this instance's lease expired): those rows are left alone."""
        if not rows:
            return set()
        async with self.write() as conn:
            ids, held = [r["id"] for r in rows], set[str]()
            for i in range(0, len(ids), _CHUNK):
                q = (
                    sa.select(tasks.c.id)
                    .where(tasks.c.id.in_(ids[i : i + _CHUNK]))
                    .where(tasks.c.instance == instance)
                    .with_for_update()
                )
                held.update((await conn.execute(q)).scalars().all())
            await _update_rows(conn, [r for r in rows if r["id"] in held])
            return set(ids) - held

    async def held_by(self, ids: list[str], instance: str) -> set[str]:
        """Those of `ids` whose rows `instance` still runs (tasks.instance)."""
        held = set[str]()
        async with self.read() as conn:
            for i in range(0, len(ids), _CHUNK):
                q = sa.select(tasks.c.id).where(tasks.c.id.in_(ids[i : i + _CHUNK])).where(tasks.c.instance == instance)
                held.update((await conn.execute(q)).scalars().all())
        return held

    async def claim(self, task_id: str, version: int, row: dict[str, Any]) -> ClaimMiss | None:
        """Start a run of a finished task: update its row (row's columns, version + 1) only if
        it is finished and still at `version`. Returns None when claimed, else what it found."""
        async with self.write() as conn:
            q = (
                sa.select(tasks.c.status, tasks.c.version, tasks.c.instance)
                .where(tasks.c.id == task_id)
                .with_for_update()
            )
            cur = (await conn.execute(q)).first()
            if cur is None:
                return ClaimMiss(None, None, None)
            if cur.status != FINISHED or cur.version != version:
                return ClaimMiss(cur.status, cur.version, cur.instance)
            values = {k: v for k, v in row.items() if k != "id"}
            await conn.execute(sa.update(tasks).where(tasks.c.id == task_id).values(**values, version=version + 1))
            return None

    async def get_task(self, task_id: str) -> DbRow | None:
        async with self.read() as conn:
            return (await conn.execute(sa.select(tasks).where(tasks.c.id == task_id))).first()

    async def task_head(self, task_id: str) -> DbRow | None:
        """(version, status, updated_at, instance, state_id) of a row: is a copy held in memory
        current? (state_id: a state written behind the row changes only it.)"""
        async with self.read() as conn:
            q = sa.select(tasks.c.version, tasks.c.status, tasks.c.updated_at, tasks.c.instance, tasks.c.state_id)
            return (await conn.execute(q.where(tasks.c.id == task_id))).first()

    async def task_exists(self, task_id: str) -> bool:
        async with self.read() as conn:
            q = sa.select(tasks.c.id).where(tasks.c.id == task_id)
            return (await conn.execute(q)).first() is not None

    async def tagged(self, owner: str | None, tag: str, *, prefix: bool = False) -> list[tuple[str, str]]:
        """(tag, id) of `owner`'s tasks tagged `tag` (prefix: tags starting with it), oldest
        first. One read of the (owner, tag) index."""
        own = tasks.c.owner == owner if owner is not None else tasks.c.owner.is_(None)
        # LIKE finds the candidates (on SQLite it ignores ASCII case); the exact test is ours
        match = tasks.c.tag.startswith(tag, autoescape=True) if prefix else tasks.c.tag == tag
        q = sa.select(tasks.c.tag, tasks.c.id).where(own, match).order_by(tasks.c.created_at, tasks.c.id)
        async with self.read() as conn:
            rows = (await conn.execute(q)).all()
        return [(r.tag, r.id) for r in rows if (r.tag.startswith(tag) if prefix else r.tag == tag)]

    async def digests(self, owner: str | None, tag: str, limit: int) -> list[tuple[str, int, bytes]]:
        """(id, tokens, digest) of `owner`'s `limit` newest tasks tagged `tag` that have a digest
        (not running), newest first: the (owner, tag) index and each row's blob length, not the
        tokens themselves."""
        own = tasks.c.owner == owner if owner is not None else tasks.c.owner.is_(None)
        q = (
            sa.select(tasks.c.id, sa.func.length(tasks.c.tokens).label("nbytes"), tasks.c.digest)
            .where(own, tasks.c.tag == tag, tasks.c.digest.is_not(None))
            .order_by(tasks.c.created_at.desc(), tasks.c.id.desc())
            .limit(limit)
        )
        async with self.read() as conn:
            rows = (await conn.execute(q)).all()
        return [(r.id, r.nbytes // 4, bytes.fromhex(r.digest)) for r in rows]

    async def delete_task(self, task_id: str, instance: str | None = None) -> tuple[bool, int]:
        """Delete a row and its state when no other task names it: (found, non-template state
        bytes dropped). With `instance`: not a row running on another instance (RowHeld; the
        test and the delete are one statement, so a claim elsewhere cannot slip between)."""
        cond = [tasks.c.id == task_id]
        if instance is not None:
            cond.append(sa.or_(tasks.c.status == FINISHED, tasks.c.instance.is_(None), tasks.c.instance == instance))
        async with self.write() as conn:
            row = (await conn.execute(sa.select(tasks.c.state_id).where(tasks.c.id == task_id))).first()
            if row is None:
                return False, 0
            if (await conn.execute(sa.delete(tasks).where(*cond))).rowcount == 0:
                holder = (await conn.execute(sa.select(tasks.c.instance).where(tasks.c.id == task_id))).first()
                if holder is None:
                    return False, 0  # deleted meanwhile by another server
                raise RowHeld(holder.instance)
            return True, (await drop_state_if_unused(conn, row.state_id) if row.state_id else 0)

    async def mark_interrupted(self, live: Iterable[str] = ()) -> list[str]:
        """Tasks running (PREFILL/READY/RUNNING) on no instance in `live` -> FINISHED with
        finish_reason 'interrupted' (text and last stored state kept). Returns their ids."""
        async with self.write() as conn:
            return await interrupt_orphans(conn, set(live))

    async def counts(self) -> dict[str, int]:
        async with self.read() as conn:
            n_tasks = (await conn.execute(sa.select(sa.func.count()).select_from(tasks))).scalar_one()
            n_states = (await conn.execute(sa.select(sa.func.count()).select_from(states))).scalar_one()
        return {"tasks": int(n_tasks), "states": int(n_states)}


async def interrupt_orphans(conn: AsyncConnection, live: set[str]) -> list[str]:
    """In a write transaction: mark the running tasks of no instance in `live` interrupted, and
    delete the claims of templates among them (claims.drop_unmade); their ids. A row a stalled
    server's transaction holds is left for a later heartbeat (PostgreSQL: skip locked)."""
    gone = sa.and_(tasks.c.status != FINISHED, sa.or_(tasks.c.instance.is_(None), tasks.c.instance.not_in(live)))
    q = sa.select(tasks.c.id, unmade().label("unmade")).where(gone)
    orphans = list(await conn.execute(q.with_for_update(skip_locked=True)))
    await drop_unmade(conn, [r.id for r in orphans if r.unmade])
    ids = [r.id for r in orphans if not r.unmade]
    for i in range(0, len(ids), _CHUNK):
        await conn.execute(
            sa.update(tasks)
            .where(tasks.c.id.in_(ids[i : i + _CHUNK]))
            .values(status=FINISHED, finish_reason="interrupted", instance=None, updated_at=time.time())
        )
    return ids + [r.id for r in orphans if r.unmade]


async def _save_one(
    db: Database, conn: AsyncConnection, task_row: Row | None, state: Row | None, drop_states: Iterable[str]
) -> int:
    if state is not None:
        await db.allow(conn, written=len(state["data"]))  # a blob of megabytes: more time (pgconnect)
        await conn.execute(INSERT_STATE, state)
    if task_row is not None:
        await _upsert_rows(conn, [task_row])
    dropped = 0
    for sid in drop_states:
        dropped += await drop_state_if_unused(conn, sid)
    return dropped


async def _update_rows(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    """One executemany UPDATE of task rows that all have the same columns (none: nothing)."""
    if not rows:
        return
    cols = [k for k in rows[0] if k != "id"]
    stmt = sa.update(tasks).where(tasks.c.id == sa.bindparam("b_id")).values({c: sa.bindparam(f"b_{c}") for c in cols})
    await conn.execute(stmt, [{f"b_{k}": v for k, v in r.items()} for r in rows])


async def _upsert_rows(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    """Upsert task rows that all have the same columns: one query for the ids that exist, one
    executemany UPDATE, one executemany INSERT. The same id twice: the later row wins."""
    last = list({r["id"]: r for r in rows}.values())
    ids, have = [r["id"] for r in last], set[str]()
    for i in range(0, len(ids), _CHUNK):
        q = sa.select(tasks.c.id).where(tasks.c.id.in_(ids[i : i + _CHUNK]))
        have.update((await conn.execute(q)).scalars().all())
    await _update_rows(conn, [r for r in last if r["id"] in have])
    new = [r for r in last if r["id"] not in have]
    if new:
        await conn.execute(sa.insert(tasks), new)


# --- template names: one per key ---------------------------------------------------------------
