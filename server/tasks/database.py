"""The database connection of the task store: URLs, the write lock, whether the database answers;
SQLite's set-up: server/tasks/sqlitefile.py; the mapping of transient database errors to
TaskUnavailable (HTTP 503, retryable): server/tasks/dbfaults.py.

SQLite runs in WAL mode with synchronous=FULL: a commit that returned is on disk even after a
power loss. Every write transaction begins IMMEDIATE: it takes the write lock first, waiting up
to the busy timeout for another process (a replica on the same file), instead of failing at its
first write. Writes in one process are serialized by one lock; reads run concurrently.
PostgreSQL's waits are bounded by the same busy timeout (server/tasks/pgconnect.py says which
bound applies where); a wait beyond it is TaskUnavailable too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

from server.tasks import migrate, pgconnect
from server.tasks.dbfaults import (
    DamagedPage,
    DatabaseDamaged,
    Outages,
    contention,
    damage_line,
    damaged,
    locked,
    unavailable,
)
from server.tasks.errors import TaskUnavailable
from server.tasks.sqlitefile import file_id, read_every_tree, sqlite_setup

__all__ = ["DamagedPage", "Database", "DatabaseDamaged", "damaged", "database_url", "read_every_tree", "unavailable"]

log = logging.getLogger("server.tasks.store")

_ASYNC_SCHEMES = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg"}


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


class Database:
    """An async SQLAlchemy engine on the task database, migrated to the head schema at open."""

    def __init__(self, db: str, *, busy_timeout: float = 30.0) -> None:
        self.url = database_url(db)
        self.engine: AsyncEngine | None = None
        self.is_sqlite = self.url.startswith("sqlite")
        self.busy_timeout = float(busy_timeout)
        self.revision_before: str | None = None
        self.revision: str = ""
        self._wlock = asyncio.Lock()
        self._damage_said = False  # (_task_errors)
        self._moved_said = False
        self._file_id: tuple[int, int] | None = None  # SQLite: (st_dev, st_ino) of the file opened (_check_file)
        self.outages = Outages()
        """Whether the database answered the last block of write() or read() (dbfaults.Outages)."""
        self._lifted: dict[int, Any] = {}  # id(conn) -> its asyncpg connection, while allow() lifts its bound

    # --- life cycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        """Connect, read the trees (SQLite: read_every_tree), migrate. A damaged SQLite file:
        DatabaseDamaged (one line naming the file and how to salvage it), nothing changed."""
        url: Any = self.url
        kw: dict[str, Any] = {}
        if not self.is_sqlite:  # pre-ping: survives a server restart; the bounds: pgconnect
            url, args = pgconnect.connect_args(self.url, self.busy_timeout)
            kw = {"pool_pre_ping": True, "pool_timeout": self.busy_timeout, "connect_args": args}
        if self.url == "sqlite+aiosqlite://":
            kw = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
        try:
            self.engine = create_async_engine(url, **kw)
            if not self.is_sqlite:
                tcp = pgconnect.tcp_options(self.url)
                event.listen(self.engine.sync_engine, "connect", lambda conn, _: pgconnect.tcp_setup(conn, tcp))
        except ModuleNotFoundError as exc:  # e.g. postgresql:// without asyncpg installed
            raise RuntimeError(
                f"the task database {self.url.split('://')[0]}:// needs the {exc.name} "
                f"package (pip install {exc.name}; for PostgreSQL, in the server's source tree: "
                f"pip install -e '.[postgres]')"
            ) from exc
        if self.is_sqlite:
            sqlite_setup(self.engine, int(self.busy_timeout * 1000))
        try:
            await self._migrate()
        except BaseException as exc:
            await self.engine.dispose()
            self.engine = None
            if damaged(exc):
                raise DatabaseDamaged(self.url, exc) from None
            raise
        if self.is_sqlite and self.url != "sqlite+aiosqlite://":
            self._file_id = file_id(self._path)
        if not self.is_sqlite:
            async with self.read() as conn:
                schema = (await conn.exec_driver_sql("SELECT current_schema()")).scalar()
            log.info("task database %s: its tables in PostgreSQL schema %r", self.url, schema)
        if self.revision_before != self.revision:
            log.info("task database %s: schema %s -> %s", self.url, self.revision_before or "empty", self.revision)

    async def _migrate(self) -> None:
        """Bring the schema to head. Migrations hold the database's write lock from the start
        (SQLite: BEGIN IMMEDIATE; PostgreSQL: an advisory lock in migrate.upgrade), so servers
        opening one new database together run them one after the other instead of failing on
        each other. SQLite can still answer "locked" without waiting (a new file switching to
        WAL while another process opens it): such an attempt is retried until busy_timeout. A
        file's trees are read first (read_every_tree): a damaged file is refused unchanged."""
        assert self.engine is not None
        deadline = time.monotonic() + self.busy_timeout
        read = not self.is_sqlite or self.url == "sqlite+aiosqlite://"  # (in memory: new)
        while True:
            try:
                if not read:
                    async with self.engine.connect() as conn:
                        await conn.run_sync(read_every_tree, self.url)
                    read = True
                async with self._connect_at_open() as conn:
                    conn = await conn.execution_options(sqlite_immediate=True)
                    await self.allow(conn, seconds=pgconnect.MIGRATION_STATEMENT_S)
                    async with conn.begin():
                        self.revision_before, self.revision = await conn.run_sync(migrate.upgrade)
                return
            except Exception as exc:
                if not (self.is_sqlite and locked(exc)) or time.monotonic() > deadline:
                    raise
                log.info("task database %s is locked by another process opening it; retrying", self.url)
                await asyncio.sleep(0.05 + random.random() * 0.2)

    @asynccontextmanager
    async def _connect_at_open(self) -> AsyncIterator[AsyncConnection]:
        """The first connection; a PostgreSQL server that does not answer in time: TimeoutError
        saying where and for how long (asyncpg's own names neither)."""
        assert self.engine is not None
        conn = self.engine.connect()
        try:
            await conn.start()
        except (TimeoutError, asyncio.TimeoutError):
            if self.is_sqlite:
                raise
            raise pgconnect.connect_timed_out(self.url, self.busy_timeout) from None
        try:
            yield conn
        finally:
            self._restore(conn)
            await conn.close()

    async def close(self) -> None:
        """Dispose of the connections; a PostgreSQL server that does not answer (frozen) is
        given busy_timeout in all, then its connections are dropped unclosed (nothing is lost:
        a transaction not committed is rolled back by the server)."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        try:
            await asyncio.wait_for(engine.dispose(), None if self.is_sqlite else self.busy_timeout)
        except (TimeoutError, asyncio.TimeoutError):
            log.warning("the task database did not answer while its connections closed; dropped them")

    def _db(self) -> AsyncEngine:
        if self.engine is None:
            raise RuntimeError("the task store is not open")
        return self.engine

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """`async with store.write() as conn`: the write lock + one committed transaction
        (SQLite: BEGIN IMMEDIATE). Errors: _task_errors (TaskUnavailable, DamagedPage)."""
        async with self._wlock, self._task_errors(write=True), self._db().connect() as conn:
            self._check_file()
            conn = await conn.execution_options(sqlite_immediate=True)
            try:
                async with conn.begin():
                    yield conn
            finally:
                self._restore(conn)

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """`async with store.read() as conn`: a pooled connection for queries (errors: write's)."""
        async with self._task_errors(write=False), self._db().connect() as conn:
            try:
                yield conn
            finally:
                self._restore(conn)

    async def read_only(self) -> str | None:
        """PostgreSQL: why its transactions cannot write (a standby, default_transaction_read_only),
        or None; the start-up check refuses such a database (SQLite's read-only file fails its
        migration's write already)."""
        if self.is_sqlite:
            return None
        async with self.read() as conn:
            standby = (await conn.exec_driver_sql("SELECT pg_is_in_recovery()")).scalar()
            ro = (await conn.exec_driver_sql("SHOW transaction_read_only")).scalar()
        return "a standby in recovery" if standby else "transaction_read_only is on" if ro == "on" else None

    @property
    def _path(self) -> str:
        return self.url.split(":///", 1)[-1]

    def _check_file(self) -> None:
        """SQLite: the file at the path is still the one opened. One removed or replaced while
        the server runs would take every write into the old file, which is gone at the next
        start (acknowledged tasks lost): TaskUnavailable instead, said once in the log."""
        if self._file_id is None or file_id(self._path) == self._file_id:
            return
        msg = (f"the task database file {self._path} was removed or replaced while the server runs; nothing is "
               "stored until the server restarts (it then opens the file at that path)")  # fmt: skip
        if not self._moved_said:
            log.error("%s; what this server stored since its start is in the file it opened, if it still exists", msg)
            self._moved_said = True
        err = TaskUnavailable(msg)
        self.outages.failed(err, write=True)
        raise err

    async def allow(self, conn: AsyncConnection, *, written: int = 0, dropped: int = 0, seconds: float = 0) -> None:
        """Lift the time bound of the next statements of `conn` (in a block of write or read)
        for `written` bytes sent, `dropped` bytes of states deleted, or to `seconds` at least,
        until the block ends (pgconnect's doc says why). SQLite: nothing (no such bound)."""
        if not self.is_sqlite:
            bound = pgconnect.statement_bound(self.busy_timeout, written=written, dropped=dropped)
            raw = await pgconnect.set_bound(conn, max(seconds, bound))
            if raw is not None:
                self._lifted[id(conn)] = raw

    def _restore(self, conn: AsyncConnection) -> None:
        if (raw := self._lifted.pop(id(conn), None)) is not None:
            pgconnect.reset_bound(raw, pgconnect.statement_bound(self.busy_timeout))

    @asynccontextmanager
    async def _task_errors(self, *, write: bool) -> AsyncIterator[None]:
        """A transient database error of the block as TaskUnavailable (unavailable()); a damaged
        page (one damaged while serving: a damaged file is refused at open) as DamagedPage, said
        once in the log with the file and how to salvage it, not as SQLAlchemy's SQL per write."""
        try:
            yield
        except Exception as exc:
            if damaged(exc) and not isinstance(exc, DamagedPage):
                then = ", found while serving: what needs those pages fails (503, nothing stored). Stop the server, "
                log.log(logging.DEBUG if self._damage_said else logging.ERROR, "%s", damage_line(self.url, exc, then))
                self._damage_said = True
                page = DamagedPage(exc)
                self.outages.failed(page, write=write)
                raise page from None
            err = unavailable(exc)
            if err is None:
                raise
            if not contention(exc):  # (rows another server holds: not the database's outage)
                self.outages.failed(err, write=write)
            raise err from exc
        self.outages.answered(write=write)

    async def db_now(self, conn: AsyncConnection) -> float:
        """The database's clock in epoch seconds (leases compare times of several hosts)."""
        if self.is_sqlite:
            q = "SELECT (julianday('now') - 2440587.5) * 86400.0"
        else:
            q = "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS double precision)"
        return float((await conn.exec_driver_sql(q)).scalar_one())
