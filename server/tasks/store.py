"""The task database: SQLAlchemy 2 async (aiosqlite by default; any async URL, e.g. asyncpg).

The connection (WAL + synchronous=FULL on SQLite, so an acknowledged task survives a power
loss; IMMEDIATE write transactions; transient errors as TaskUnavailable, HTTP 503): database.py.
The list's page, filters and prompt search: listing.py. All SQL here is plain SQLAlchemy Core that
PostgreSQL runs too.

Run writes of existing rows are fenced: a claim (`claim`) moves a finished row to this instance
only if nobody else runs it and it is the version this server read; later writes of the run
(`update_owned`) touch only rows this instance still holds. Instance leases: server/tasks/lease.py.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, NamedTuple

import orjson
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from server.tasks.claims import drop_unmade, unmade
from server.tasks.codec import EncodedState
from server.tasks.database import Database, database_url, unavailable
from server.tasks.errors import TaskConflict
from server.tasks.records import qualified
from server.tasks.schema import INSERT_STATE, DbRow, states, tasks

__all__ = [
    "ClaimMiss",
    "Database",
    "RowHeld",
    "Store",
    "TagTaken",
    "database_url",
    "state_row",
    "unavailable",
]

_CHUNK = 500  # ids per IN (...) list
FINISHED = 3


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
    """Task and state queries (the connection, locking and errors: Database; the list: listing.Listing)."""

    # --- tasks ---------------------------------------------------------------------------------
    async def save(
        self,
        task_row: dict[str, Any] | None = None,
        state: dict[str, Any] | None = None,
        drop_states: Iterable[str] = (),
    ) -> int:
        """One transaction: insert `state` (a states row), upsert `task_row`, then drop the
        states in `drop_states` that no task references any more. Returns the non-template
        state bytes dropped."""
        async with self.write() as conn:
            return await _save_one(conn, task_row, state, drop_states)

    async def save_each(
        self, items: AsyncIterator[tuple[dict[str, Any] | None, dict[str, Any] | None, Iterable[str]]]
    ) -> int:
        """save(task_row, state, drop_states) for each item `items` yields, all in ONE
        transaction (items are taken one at a time, so they may be produced lazily)."""
        dropped = 0
        async with self.write() as conn:
            async for task_row, state, drop_states in items:
                dropped += await _save_one(conn, task_row, state, drop_states)
        return dropped

    async def insert_new(self, task_row: dict[str, Any], state: dict[str, Any] | None = None) -> bool:
        """Insert a new task row (and its state) in one transaction unless a row with its id
        exists: False then, and nothing is written. For ids that are names (templates), which
        two servers of one database may pick at once: the first commit wins. A key's template
        whose name the key's other template has (public `_name`, private `_name@<owner>`):
        TaskConflict, nothing written (_name_free). A state whose id names its content
        (imports.state_id_of) may be stored already, with the same checksum: it is kept (the
        forks of a deleted template of the same file still name it)."""
        try:
            async with self.write() as conn:
                await _lock_name(conn, task_row)
                q = sa.select(tasks.c.id).where(tasks.c.id == task_row["id"])
                if (await conn.execute(q)).first() is not None:
                    return False
                await _name_free(conn, task_row)
                if state is not None and not await _has_state(conn, state["id"], state["checksum"]):
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
        """(version, status, updated_at, instance) of a row: is a copy held in memory current?"""
        async with self.read() as conn:
            q = sa.select(tasks.c.version, tasks.c.status, tasks.c.updated_at, tasks.c.instance)
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
            return True, (await _drop_state_if_unused(conn, row.state_id) if row.state_id else 0)

    async def mark_interrupted(self, live: Iterable[str] = ()) -> list[str]:
        """Tasks running (PREFILL/READY/RUNNING) on no instance in `live` -> FINISHED with
        finish_reason 'interrupted' (text and last stored state kept). Returns their ids."""
        async with self.write() as conn:
            return await interrupt_orphans(conn, set(live))

    # --- states --------------------------------------------------------------------------------
    async def get_state(self, state_id: str) -> DbRow | None:
        async with self.read() as conn:
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
        async with self.write() as conn:
            q = sa.select(tasks.c.state_id, tasks.c.state_pos).where(tasks.c.id == task_id).with_for_update()
            cur = (await conn.execute(q)).first()
            if cur is None or (cur.state_id is not None and cur.state_pos > pos):
                return False, 0
            await conn.execute(INSERT_STATE, state)
            await conn.execute(
                sa.update(tasks).where(tasks.c.id == task_id).values(state_id=state["id"], state_pos=pos)
            )
            dropped = await _drop_state_if_unused(conn, cur.state_id) if cur.state_id else 0
            return True, dropped

    async def drop_state(self, state_id: str) -> int:
        """Delete a state (a corrupt one) and clear the rows that name it (state_pos 0: their
        next run rebuilds from zero). Returns the non-template bytes dropped."""
        async with self.write() as conn:
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
        async with self.write() as conn:
            for i in range(0, len(ids), _CHUNK):
                await conn.execute(
                    sa.update(states).where(states.c.id.in_(ids[i : i + _CHUNK])).values(last_used=when or time.time())
                )

    async def states_bytes(self, templates: bool | None = False) -> int:
        q = sa.select(sa.func.coalesce(sa.func.sum(states.c.nbytes), 0))
        if templates is not None:
            q = q.where(states.c.is_template == templates)
        async with self.read() as conn:
            return int((await conn.execute(q)).scalar_one())

    async def states_count(self, templates: bool | None = False) -> int:
        """The number of stored states (non-template ones by default; None: all). Counted on
        the (is_template, last_used) index, so SQLite never reads the state blobs' pages."""
        q = sa.select(sa.func.count()).select_from(states)
        if templates is not None:
            q = q.where(states.c.is_template == templates)
        async with self.read() as conn:
            return int((await conn.execute(q)).scalar_one())

    async def enforce_budget(self, budget: int, keep: set[str], prefer: Iterable[str] = ()) -> tuple[list[str], int]:
        """Drop least recently used non-template states until they fit in `budget` bytes, never
        one in `keep`, one in `prefer` only when the others do not suffice; tasks that pointed
        at them keep their text (state_id NULL, state_pos 0).
        Returns (dropped state ids, non-template state bytes left)."""
        async with self.write() as conn:
            nt = states.c.is_template == sa.false()
            q = sa.select(sa.func.coalesce(sa.func.sum(states.c.nbytes), 0)).where(nt)
            total = int((await conn.execute(q)).scalar_one())
            if total <= budget:
                return [], total
            victims: list[str] = []
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
            for i in range(0, len(victims), _CHUNK):
                part = victims[i : i + _CHUNK]
                await conn.execute(sa.delete(states).where(states.c.id.in_(part)))
                await conn.execute(
                    sa.update(tasks).where(tasks.c.state_id.in_(part)).values(state_id=None, state_pos=0)
                )
            return victims, total

    async def counts(self) -> dict[str, int]:
        async with self.read() as conn:
            n_tasks = (await conn.execute(sa.select(sa.func.count()).select_from(tasks))).scalar_one()
            n_states = (await conn.execute(sa.select(sa.func.count()).select_from(states))).scalar_one()
        return {"tasks": int(n_tasks), "states": int(n_states)}


def state_row(state_id: str, task_id: str, enc: EncodedState, is_template: bool) -> dict[str, Any]:
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


async def interrupt_orphans(conn: AsyncConnection, live: set[str]) -> list[str]:
    """In a write transaction: mark the running tasks of no instance in `live` interrupted,
    and delete the claims of templates among them (claims.drop_unmade). Returns their ids."""
    q = sa.select(tasks.c.id, tasks.c.instance, unmade().label("unmade")).where(tasks.c.status != FINISHED)
    orphans = [r for r in await conn.execute(q) if r.instance is None or r.instance not in live]
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
    conn: AsyncConnection, task_row: dict[str, Any] | None, state: dict[str, Any] | None, drop_states: Iterable[str]
) -> int:
    if state is not None:
        await conn.execute(INSERT_STATE, state)
    if task_row is not None:
        await _upsert_rows(conn, [task_row])
    dropped = 0
    for sid in drop_states:
        dropped += await _drop_state_if_unused(conn, sid)
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


async def _has_state(conn: AsyncConnection, state_id: str, checksum: str) -> bool:
    q = sa.select(states.c.id).where(states.c.id == state_id, states.c.checksum == checksum)
    return (await conn.execute(q)).first() is not None


async def _drop_state_if_unused(conn: AsyncConnection, state_id: str) -> int:
    """Delete a state no task names; returns its bytes if it was a non-template one, else 0."""
    used = sa.select(tasks.c.id).where(tasks.c.state_id == state_id).exists()
    row = (
        await conn.execute(sa.select(states.c.nbytes, states.c.is_template).where(states.c.id == state_id).where(~used))
    ).first()
    if row is None:
        return 0
    await conn.execute(sa.delete(states).where(states.c.id == state_id))
    return 0 if row.is_template else int(row.nbytes)


# --- template names: one per key ---------------------------------------------------------------
def _keyed_name(row: dict[str, Any]) -> tuple[str, str] | None:
    """(owner, name: `_<name>`) of a new template row of an API key (None: not one; a template
    made without keys is public, its id is its name and the primary key keeps it unique)."""
    if row.get("kind") != "template" or row.get("owner") is None:
        return None
    return row["owner"], row["id"].split("@", 1)[0]


async def _lock_name(conn: AsyncConnection, row: dict[str, Any]) -> None:
    """In a write transaction, first: lock the key's template name till the commit, so that two
    servers inserting a public `_name` and a private `_name@<owner>` of one key at once run one
    after the other, and the later one's _name_free sees the first's row. SQLite: its write
    transactions already are (BEGIN IMMEDIATE). PostgreSQL: a transaction-scoped advisory lock
    on (owner, name); READ COMMITTED, each later statement reads what committed meanwhile."""
    keyed = _keyed_name(row)
    if keyed is None or conn.dialect.name != "postgresql":
        return
    digest = hashlib.sha256("\0".join(("template name", *keyed)).encode()).digest()
    key = int.from_bytes(digest[:8], "big", signed=True)  # pg_advisory_xact_lock takes a bigint
    await conn.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.bindparam("k", key, type_=sa.BigInteger))))


async def _name_free(conn: AsyncConnection, row: dict[str, Any]) -> None:
    """After _lock_name: TaskConflict (TaskManager.as_template's 409, the same message) when the
    owner of the new template `row` has the other template of its name, made or being made (its
    claim): a private one would shadow the public one from that key (docs/task-api.md)."""
    keyed = _keyed_name(row)
    if keyed is None:
        return
    owner, name = keyed
    other = qualified(name, owner) if row["id"] == name else name
    q = sa.select(tasks.c.id).where(tasks.c.id == other, tasks.c.owner == owner)
    if (await conn.execute(q)).first() is not None:
        kind = "private" if row["public"] else "public"
        raise TaskConflict(f"template {name!r} already exists ({kind})", param="name")
