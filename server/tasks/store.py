"""The task database: SQLAlchemy 2 async (aiosqlite by default; any async URL, e.g. asyncpg).

SQLite runs in WAL mode with synchronous=FULL: a commit that returned is on disk even after a
power loss, so a task the server acknowledged is never lost. Writes are serialized by one lock
(one writer per process is what SQLite wants anyway); reads run concurrently on the pool. All
SQL here is plain SQLAlchemy Core that PostgreSQL runs too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

from server.tasks import migrate
from server.tasks.codec import EncodedState
from server.tasks.schema import DbRow, states, tasks

log = logging.getLogger("server.tasks.store")

_CHUNK = 500  # ids per IN (...) list


_ASYNC_SCHEMES = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg",
                  "postgres": "postgresql+asyncpg"}


def database_url(db: str) -> str:
    """A settings value (path or URL) -> an async SQLAlchemy URL."""
    if "://" in db:  # the blocking drivers' schemes name their async twins here
        scheme, rest = db.split("://", 1)
        return f"{_ASYNC_SCHEMES.get(scheme, scheme)}://{rest}"
    if db in ("", ":memory:"):
        return "sqlite+aiosqlite://"
    path = os.path.abspath(os.path.expanduser(db))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return f"sqlite+aiosqlite:///{path}"


def _sqlite_setup(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (transactional DDL)
        cur = dbapi_conn.cursor()
        # page_size first: it only applies to a database not yet written (a new file). States
        # are blobs of megabytes (21 MB for 2.9B in fp32), stored as chains of overflow pages:
        # a 21 MB commit took 126 ms with 4 KiB pages and 27 ms with 64 KiB ones (WAL,
        # synchronous=FULL, same disk, interleaved); one-row updates were no slower.
        # busy_timeout before journal_mode: switching a new file to WAL takes a lock that another
        # process opening the same file at the same time may hold.
        for pragma in ("busy_timeout=30000", "page_size=65536", "journal_mode=WAL", "synchronous=FULL",
                       "journal_size_limit=67108864", "temp_store=MEMORY"):
            cur.execute(f"PRAGMA {pragma}")
        cur.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        # IMMEDIATE takes the write lock up front (waiting up to busy_timeout for it); a deferred
        # transaction that read first and then writes fails at once if another process wrote.
        immediate = conn.get_execution_options().get("sqlite_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


class Store:
    def __init__(self, db: str) -> None:
        self.url = database_url(db)
        self.engine: AsyncEngine | None = None
        self.is_sqlite = self.url.startswith("sqlite")
        self.revision_before: str | None = None
        self.revision: str = ""
        self._wlock = asyncio.Lock()

    # --- life cycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        kw: dict[str, Any] = {} if self.is_sqlite else {"pool_pre_ping": True}  # survives a server restart
        if self.url == "sqlite+aiosqlite://":
            kw = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
        try:
            self.engine = create_async_engine(self.url, **kw)
        except ModuleNotFoundError as exc:  # e.g. postgresql:// without asyncpg installed
            raise RuntimeError(f"the task database {self.url.split('://')[0]}:// needs the {exc.name} "
                               f"package (pip install {exc.name}; for PostgreSQL: pip install "
                               f"'rwkv-task-server[postgres]')") from exc
        if self.is_sqlite:
            _sqlite_setup(self.engine)
        try:
            # migrations hold the database's write lock from the start (SQLite: BEGIN IMMEDIATE;
            # PostgreSQL: an advisory lock in migrate.upgrade), so servers opening one new
            # database together run them one after the other instead of failing on each other
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(sqlite_immediate=True)
                async with conn.begin():
                    self.revision_before, self.revision = await conn.run_sync(migrate.upgrade)
        except BaseException:
            await self.engine.dispose()
            self.engine = None
            raise
        if self.revision_before != self.revision:
            log.info("task database %s: schema %s -> %s", self.url, self.revision_before or "empty", self.revision)

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.dispose()
            self.engine = None

    def _db(self) -> AsyncEngine:
        if self.engine is None:
            raise RuntimeError("the task store is not open")
        return self.engine

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        """`async with store._write() as conn`: the write lock + one committed transaction."""
        async with self._wlock, self._db().begin() as conn:
            yield conn

    # --- tasks ---------------------------------------------------------------------------------
    async def save(self, task_row: dict[str, Any] | None = None, state: dict[str, Any] | None = None,
                   drop_states: Iterable[str] = ()) -> None:
        """One transaction: insert `state` (a states row), upsert `task_row`, then drop the
        states in `drop_states` that no task references any more."""
        async with self._write() as conn:
            await _save_one(conn, task_row, state, drop_states)

    async def save_each(self, items: AsyncIterator[tuple[dict[str, Any] | None, dict[str, Any] | None,
                                                        Iterable[str]]]) -> None:
        """save(task_row, state, drop_states) for each item `items` yields, all in ONE
        transaction (items are taken one at a time, so they may be produced lazily)."""
        async with self._write() as conn:
            async for task_row, state, drop_states in items:
                await _save_one(conn, task_row, state, drop_states)

    async def save_rows(self, rows: list[dict[str, Any]]) -> None:
        """Upsert whole task rows (to_row's columns) in one transaction (_upsert_rows). The same
        id twice: the later row wins, as if the rows were saved one after the other."""
        if not rows:
            return
        async with self._write() as conn:
            await _upsert_rows(conn, rows)

    async def save_progress(self, rows: list[dict[str, Any]]) -> None:
        """Update existing task rows (all with the same columns), one transaction and one
        executemany; rows no longer in the table (deleted) are left alone."""
        if not rows:
            return
        async with self._write() as conn:
            await _update_rows(conn, rows)

    async def get_task(self, task_id: str) -> DbRow | None:
        async with self._db().connect() as conn:
            return (await conn.execute(sa.select(tasks).where(tasks.c.id == task_id))).first()

    async def task_exists(self, task_id: str) -> bool:
        async with self._db().connect() as conn:
            q = sa.select(tasks.c.id).where(tasks.c.id == task_id)
            return (await conn.execute(q)).first() is not None

    async def delete_task(self, task_id: str) -> bool:
        async with self._write() as conn:
            row = (await conn.execute(sa.select(tasks.c.state_id).where(tasks.c.id == task_id))).first()
            if row is None:
                return False
            await conn.execute(sa.delete(tasks).where(tasks.c.id == task_id))
            if row.state_id:
                await _drop_state_if_unused(conn, row.state_id)
            return True

    async def list_tasks(self, owner: str | None, all_owners: bool, kind: str | None,
                         limit: int, offset: int) -> tuple[list[DbRow], int]:
        cols = [tasks.c.id, tasks.c.kind, tasks.c.status, tasks.c.finish_reason, tasks.c.created_at,
                tasks.c.updated_at, tasks.c.parent_id, tasks.c.completion_tokens]
        cond = []
        if not all_owners:
            cond.append(tasks.c.owner == owner if owner is not None else tasks.c.owner.is_(None))
        if kind:
            cond.append(tasks.c.kind == kind)
        async with self._db().connect() as conn:
            total = (await conn.execute(sa.select(sa.func.count()).select_from(tasks).where(*cond))).scalar_one()
            q = (sa.select(*cols).where(*cond).order_by(tasks.c.created_at.desc(), tasks.c.id)
                 .limit(limit).offset(offset))
            return list((await conn.execute(q)).all()), int(total)

    async def mark_interrupted(self) -> list[str]:
        """Tasks that were PREFILL/READY/RUNNING when the last process died -> FINISHED,
        finish_reason 'interrupted' (text and last stored state kept)."""
        async with self._write() as conn:
            ids = [r.id for r in await conn.execute(sa.select(tasks.c.id).where(tasks.c.status != 3))]
            if ids:
                await conn.execute(sa.update(tasks).where(tasks.c.status != 3).values(
                    status=3, finish_reason="interrupted", updated_at=time.time()))
            return ids

    # --- states --------------------------------------------------------------------------------
    async def get_state(self, state_id: str) -> DbRow | None:
        async with self._db().connect() as conn:
            q = sa.select(states.c.meta, states.c.data, states.c.checksum, states.c.signature,
                          states.c.nbytes, states.c.is_template).where(states.c.id == state_id)
            return (await conn.execute(q)).first()

    async def touch_states(self, state_ids: Iterable[str], when: float | None = None) -> None:
        ids = list(state_ids)
        if not ids:
            return
        async with self._write() as conn:
            for i in range(0, len(ids), _CHUNK):
                await conn.execute(sa.update(states).where(states.c.id.in_(ids[i:i + _CHUNK]))
                                   .values(last_used=when or time.time()))

    async def states_bytes(self, templates: bool | None = False) -> int:
        q = sa.select(sa.func.coalesce(sa.func.sum(states.c.nbytes), 0))
        if templates is not None:
            q = q.where(states.c.is_template == templates)
        async with self._db().connect() as conn:
            return int((await conn.execute(q)).scalar_one())

    async def enforce_budget(self, budget: int, keep: set[str],
                             prefer: Iterable[str] = ()) -> tuple[list[str], int]:
        """Drop least recently used non-template states until they fit in `budget` bytes, never
        one in `keep`, one in `prefer` only when the others do not suffice; tasks that pointed
        at them keep their text (state_id NULL, state_pos 0).
        Returns (dropped state ids, non-template state bytes left)."""
        async with self._write() as conn:
            nt = states.c.is_template == sa.false()
            total = int((await conn.execute(sa.select(sa.func.coalesce(sa.func.sum(states.c.nbytes), 0)).where(nt))).scalar_one())
            if total <= budget:
                return [], total
            victims: list[str] = []
            prefer = set(prefer)
            rows = (await conn.execute(sa.select(states.c.id, states.c.nbytes).where(nt)
                                       .order_by(states.c.last_used, states.c.created_at))).all()
            for r in [r for r in rows if r.id not in prefer] + [r for r in rows if r.id in prefer]:
                if total <= budget:
                    break
                if r.id in keep:
                    continue
                victims.append(r.id)
                total -= int(r.nbytes)
            for i in range(0, len(victims), _CHUNK):
                part = victims[i:i + _CHUNK]
                await conn.execute(sa.delete(states).where(states.c.id.in_(part)))
                await conn.execute(sa.update(tasks).where(tasks.c.state_id.in_(part))
                                   .values(state_id=None, state_pos=0))
            return victims, total

    async def counts(self) -> dict[str, int]:
        async with self._db().connect() as conn:
            n_tasks = (await conn.execute(sa.select(sa.func.count()).select_from(tasks))).scalar_one()
            n_states = (await conn.execute(sa.select(sa.func.count()).select_from(states))).scalar_one()
        return {"tasks": int(n_tasks), "states": int(n_states)}


def state_row(state_id: str, task_id: str, enc: EncodedState, is_template: bool) -> dict[str, Any]:
    now = time.time()
    return {"id": state_id, "task_id": task_id, "is_template": is_template,
            "signature": enc.signature, "meta": orjson.dumps(enc.meta).decode(),
            "nbytes": enc.nbytes, "checksum": enc.checksum, "data": enc.data,
            "created_at": now, "last_used": now}


async def _save_one(conn: AsyncConnection, task_row: dict[str, Any] | None, state: dict[str, Any] | None,
                    drop_states: Iterable[str]) -> None:
    if state is not None:
        await conn.execute(sa.insert(states).values(**state))
    if task_row is not None:
        await _upsert_rows(conn, [task_row])
    for sid in drop_states:
        await _drop_state_if_unused(conn, sid)


async def _update_rows(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    """One executemany UPDATE of task rows that all have the same columns (none: nothing)."""
    if not rows:
        return
    cols = [k for k in rows[0] if k != "id"]
    stmt = (sa.update(tasks).where(tasks.c.id == sa.bindparam("b_id"))
            .values({c: sa.bindparam(f"b_{c}") for c in cols}))
    await conn.execute(stmt, [{f"b_{k}": v for k, v in r.items()} for r in rows])


async def _upsert_rows(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    """Upsert task rows that all have the same columns: one query for the ids that exist, one
    executemany UPDATE, one executemany INSERT. The same id twice: the later row wins."""
    last = list({r["id"]: r for r in rows}.values())
    ids, have = [r["id"] for r in last], set[str]()
    for i in range(0, len(ids), _CHUNK):
        q = sa.select(tasks.c.id).where(tasks.c.id.in_(ids[i:i + _CHUNK]))
        have.update((await conn.execute(q)).scalars().all())
    await _update_rows(conn, [r for r in last if r["id"] in have])
    new = [r for r in last if r["id"] not in have]
    if new:
        await conn.execute(sa.insert(tasks), new)


async def _drop_state_if_unused(conn: AsyncConnection, state_id: str) -> None:
    used = sa.select(tasks.c.id).where(tasks.c.state_id == state_id).exists()
    await conn.execute(sa.delete(states).where(states.c.id == state_id).where(~used))
